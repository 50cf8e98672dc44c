"""Constrained JSON decoding: every emitted call is canonical, parses and validates; every valid
canonical call is admitted; the fast string mask equals the exact trie walk."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from distillgates.data.chat import render_conversation
from distillgates.data.generator import generate_items
from distillgates.data.registry import TOOLS
from distillgates.data.tools import canonical_call, validate_call
from distillgates.runtime.constrained import (
    S_BODY,
    Bounds,
    ConstraintViolation,
    TokenVocab,
    ToolCallConstraint,
    UnsupportedSchemaError,
    _walk,
    tool_call_constraint,
    tool_call_processor,
)
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.tokenizer import decode, encode, train_tokenizer

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_TOKENS = 1000  # far above any bounded call; reaching it means the constraint did not terminate


@pytest.fixture(scope="session")
def tok():
    """A real byte-level BPE trained on toy conversations (plus some unicode), built once."""
    texts = [render_conversation(item) for item in generate_items(0, 200)]
    texts += ["Grüße aus München, 21 °C — “quoted” text \\ back\\slash\n\ttab 東京 🙂"] * 5
    return train_tokenizer(texts, vocab_size=768)


@pytest.fixture(scope="session")
def vocab(tok):
    return TokenVocab.from_tokenizer(tok)


def ids_of(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


def random_decode(constraint: ToolCallConstraint, seed: int, scale: float, vocab_size: int = 800) -> list[int]:
    """A random "model": fresh random logits each step, greedy over the masked logits."""
    gen = torch.Generator().manual_seed(seed)
    state, out = constraint.initial_state(), []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(vocab_size, generator=gen) * scale  # (V,)
        mask = constraint.allowed_mask(state)
        logits[: mask.numel()][~mask] = float("-inf")
        logits[mask.numel() :] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == constraint.end_id:
            return out
        state = constraint.advance(state, token)
    raise AssertionError(f"constrained decode did not finish in {MAX_TOKENS} tokens")


def check_emitted(tok, constraint, ids: list[int], validate) -> dict[str, Any]:
    assert ids[-1] == constraint.end_id
    text = decode(tok, ids[:-1])
    call = json.loads(text)
    assert validate(call) == [], (text, validate(call))
    assert canonical_call(call) == text  # exactly the data format, no whitespace, canonical numbers
    assert "<|" not in text
    return call


def registry_errors(call: Any) -> list[str]:
    return validate_call(call)


# --------------------------------------------------------------------------------------
# Emitted calls are valid (registry schemas, random models)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 3.0, 20.0]))
def test_random_models_emit_valid_registry_calls(tok, seed, scale):
    constraint = tool_call_constraint(tok)
    ids = random_decode(constraint, seed, scale)
    call = check_emitted(tok, constraint, ids, registry_errors)
    assert call["name"] in {t["name"] for t in TOOLS}


def test_processor_through_the_torch_engine(tok, make_model):
    """The processor plugs into the runtime's generate loop; random tiny models emit valid calls."""
    end = ids_of(tok, "<|end|>")
    prompt = encode(tok, "<|bos|><|user|>weather in Paris?<|end|><|assistant|><|tool_call|>")
    processor = tool_call_processor(tok, prompt_opens_call=True)  # the prompt forces the call
    for seed in range(3):
        engine = TorchEngine(make_model(seed, vocab_size=800, max_seq_len=512))
        greedy = list(engine.generate(prompt, max_new_tokens=400, stop_ids=[end], logits_processor=processor))
        check_emitted(tok, processor.constraint, greedy, registry_errors)
        sampled = engine.generate(
            prompt, max_new_tokens=400, stop_ids=[end], temperature=1.0, seed=seed, logits_processor=processor
        )
        check_emitted(tok, processor.constraint, list(sampled), registry_errors)
    unconstrained = list(
        TorchEngine(make_model(0, vocab_size=800, max_seq_len=512)).generate(prompt, max_new_tokens=40)
    )
    with pytest.raises((AssertionError, ValueError)):  # the same model without the mask emits no valid call
        check_emitted(tok, processor.constraint, unconstrained, registry_errors)


# --------------------------------------------------------------------------------------
# Every valid canonical call is admitted


def _printable_text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    return st.text(min_size=min_size, max_size=max_size).filter(lambda s: "<|" not in s)


def values_for(schema: dict[str, Any], bounds: Bounds) -> st.SearchStrategy[Any]:
    """Schema-valid values within the decoding bounds (what a well-trained model would emit)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        if "pattern" in schema:
            ascii_safe = st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\<')
            return st.from_regex(schema["pattern"], fullmatch=True, alphabet=ascii_safe)
        return _printable_text(schema.get("minLength", 0), min(schema.get("maxLength", 64), bounds.max_string_chars))
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        limit = 10**bounds.max_int_digits - 1
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -limit - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", limit + 1) - 1)
        if kind == "integer":
            return st.integers(max(lo, -limit), min(hi, limit))
        scaled = st.integers(max(lo, -limit) * 100, min(hi, limit) * 100).map(lambda v: v / 100)
        return st.one_of(scaled, st.integers(max(lo, -limit), min(hi, limit)))
    if kind == "array":
        return st.lists(values_for(schema["items"], bounds), min_size=schema.get("minItems", 0), max_size=3)
    props, required = schema.get("properties", {}), set(schema.get("required", []))
    return st.fixed_dictionaries(
        {k: values_for(v, bounds) for k, v in props.items() if k in required},
        optional={k: values_for(v, bounds) for k, v in props.items() if k not in required},
    )


def assert_admitted(tok, constraint: ToolCallConstraint, call: dict[str, Any]) -> None:
    processor_ids = [*encode(tok, canonical_call(call)), constraint.end_id]
    state = constraint.initial_state()
    for i, token in enumerate(processor_ids):
        mask = constraint.allowed_mask(state)
        prefix = decode(tok, processor_ids[:i])
        assert mask[token], f"token {token} {decode(tok, [token])!r} masked after {prefix!r}"
        if token != constraint.end_id:
            state = constraint.advance(state, token)
    assert constraint.is_done(state)


@st.composite
def registry_calls(draw):
    tool = draw(st.sampled_from(TOOLS))
    return {"name": tool["name"], "arguments": draw(values_for(tool["parameters"], Bounds()))}


@SETTINGS
@given(call=registry_calls())
def test_every_valid_registry_call_is_admitted(tok, call):
    assume(not validate_call(call))
    assume(canonical_call(call) == json.dumps(json.loads(canonical_call(call)), separators=(",", ":")))
    assert_admitted(tok, tool_call_constraint(tok), call)


def test_generator_calls_are_admitted(tok):
    constraint = tool_call_constraint(tok)
    calls = [c for item in generate_items(1, 60, split="eval") for c in item["expected_calls"]]
    assert len(calls) > 20
    for call in calls:
        assert_admitted(tok, constraint, call)


# --------------------------------------------------------------------------------------
# Random schemas: valid output and admission against the same validator


PATTERNS = [r"^\d{4}-\d{2}-\d{2}$", r"^\d{2}:\d{2}$", r"^[A-Z]{3}$", r"^[a-z]+-\d{1,3}$", r"^x?\w{0,4}$"]


@st.composite
def scalar_schemas(draw):
    kind = draw(st.sampled_from(["string", "pattern", "integer", "number", "boolean", "enum"]))
    if kind == "string":
        lo = draw(st.integers(0, 3))
        return {"type": "string", "minLength": lo} | draw(
            st.sampled_from([{}, {"maxLength": lo + draw(st.integers(0, 12))}])
        )
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(PATTERNS))}
    if kind in ("integer", "number"):
        schema: dict[str, Any] = {"type": kind}
        lo = draw(st.integers(-50, 50))
        hi = lo + draw(st.integers(2, 1000))  # a gap of 1 with both ends exclusive holds no integer: refused, rightly
        schema |= draw(st.sampled_from([{}, {"minimum": lo}, {"exclusiveMinimum": lo}]))
        schema |= draw(st.sampled_from([{}, {"maximum": hi}, {"exclusiveMaximum": hi}]))
        return schema
    if kind == "boolean":
        return {"type": "boolean"}
    values = draw(st.lists(st.one_of(st.text(max_size=6), st.integers(-99, 99), st.booleans()), min_size=1, max_size=4))
    return {"enum": list(dict.fromkeys(values))}


def _array(item: dict[str, Any], min_items: int) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": min_items, "maxItems": min_items + 2}


@st.composite
def tool_schemas(draw):
    keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
    value = st.one_of(
        scalar_schemas(),
        st.builds(_array, scalar_schemas(), st.integers(0, 2)),
        st.dictionaries(keys, scalar_schemas(), min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]}
        ),
    )
    props = draw(st.dictionaries(keys, value, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=tool_schemas(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_random_schemas_valid_output_and_admission(tok, vocab, schema, seed, data):
    tools = [{"name": "tool_a", "parameters": schema}, *TOOLS[:1]]
    validators = {t["name"]: Draft202012Validator(t["parameters"]) for t in tools}

    def errors(call):
        return [e.message for e in validators[call["name"]].iter_errors(call["arguments"])]

    constraint = ToolCallConstraint(tools, vocab, ids_of(tok, "<|end|>"))
    for s in range(2):
        check_emitted(tok, constraint, random_decode(constraint, seed + s, scale=4.0), errors)
    arguments = data.draw(values_for(schema, constraint.bounds))
    call = {"name": "tool_a", "arguments": arguments}
    assume(not errors(call))
    assume(
        canonical_call(call) == json.dumps(json.loads(canonical_call(call)), separators=(",", ":"), ensure_ascii=False)
    )
    assert_admitted(tok, constraint, call)


# --------------------------------------------------------------------------------------
# Mask machinery


@SETTINGS
@given(text=_printable_text(0, 10), max_chars=st.integers(10, 13))
def test_string_fast_path_equals_trie_walk(tok, vocab, text, max_chars):
    # a short length bound so the budget cuts through the vocabulary's token lengths
    constraint = ToolCallConstraint(TOOLS, vocab, ids_of(tok, "<|end|>"), Bounds(max_string_chars=max_chars))
    prefix = '{"name":"search_documents","arguments":{"query":"' + json.dumps(text, ensure_ascii=False)[1:-1]
    state = constraint.feed(constraint.initial_state(), prefix.encode())
    assume(state is not None and state[-1][1] == S_BODY)  # e.g. a text ending in "<" leaves the fast path
    walked = torch.zeros(constraint.vocab.size, dtype=torch.bool)
    walked[_walk(constraint.vocab.trie, state, constraint.step)] = True  # exact: every token's bytes stepped
    assert torch.equal(constraint._compute_mask(state), walked)


def test_processor_scope_and_errors(tok):
    processor = tool_call_processor(tok)
    tool_call, end = ids_of(tok, "<|tool_call|>"), ids_of(tok, "<|end|>")
    logits = torch.randn(800)
    answer = encode(tok, "It is sunny.")
    assert torch.equal(processor(answer, logits), logits)  # no tool call: untouched
    call = encode(tok, '{"name":"get_weather","arguments":{"city":"Oslo"}}')
    masked = processor([tool_call, *call], logits)
    assert torch.isfinite(masked).sum() == 1 and masked[end] == logits[end]  # complete: only <|end|>
    assert torch.isinf(masked[len(tok) :]).all()  # padded model vocabulary never allowed
    after = [tool_call, *call, end, *answer]
    assert torch.equal(processor(after, logits), logits)  # after <|end|>: free again
    partial = processor([tool_call, *encode(tok, '{"name":"get_weather","arguments":{')], logits)
    assert torch.isinf(partial[end])  # an incomplete call cannot end
    allowed = [decode(tok, [i]) for i in torch.nonzero(torch.isfinite(partial)).flatten().tolist()]
    assert allowed and all(re.fullmatch(r'"(c(i(ty?)?)?|u(n(it?)?)?)?("(:"?)?)?', a) for a in allowed), allowed
    with pytest.raises(ConstraintViolation, match="not allowed"):
        processor([tool_call, *encode(tok, '{"name":"nope"')], logits)
    with pytest.raises(ValueError, match="logits have 10 entries"):
        processor([tool_call], torch.zeros(10))


def test_required_keys_and_no_duplicates(tok):
    constraint = tool_call_constraint(tok)
    feed = lambda text: constraint.feed(constraint.initial_state(), text.encode())  # noqa: E731
    assert feed('{"name":"convert_currency","arguments":{"amount":5}') is None  # required keys missing
    assert feed('{"name":"get_weather","arguments":{"city":"A","city"') is None  # duplicate key
    assert feed('{"name":"get_weather","arguments":{"city":"A","unit":"kelvin"') is None  # not in enum
    assert feed('{"name":"search_documents","arguments":{"query":"q","max_results":6') is None  # maximum 5
    assert feed('{"name":"search_documents","arguments":{"query":"q","max_results":0') is None  # minimum 1
    assert feed('{"name":"convert_currency","arguments":{"amount":-') is None  # exclusiveMinimum 0
    assert feed('{"name":"convert_currency","arguments":{"amount":0,') is None
    assert feed('{"name":"calculate","arguments":{"a":1.50') is not None  # may still become 1.505
    assert feed('{"name":"calculate","arguments":{"a":1.50,') is None  # json.dumps never writes 1.50
    assert feed('{"name":"calculate","arguments":{"a":01') is None
    assert feed('{"name":"get_weather","arguments":{"city":"a<|') is None  # would re-tokenize as a special
    assert feed('{"name":"get_weather", "arguments"') is None  # compact: no whitespace
    assert feed('{"name":"create_calendar_event","arguments":{"title":"x","date":"2025-1') is not None
    assert feed('{"name":"create_calendar_event","arguments":{"title":"x","date":"2025-1"') is None  # pattern
    assert constraint.is_done(feed('{"name":"get_weather","arguments":{"city":"Zürich \\"Q\\"\\n"}}'))


def test_unsupported_schemas_fail_up_front(vocab):
    def build(schema):
        return ToolCallConstraint([{"name": "t", "parameters": schema}], vocab, end_id=8)

    with pytest.raises(UnsupportedSchemaError, match=r"t\.parameters\.properties\.x: keyword\(s\) \['multipleOf'\]"):
        build({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 3}}})
    with pytest.raises(UnsupportedSchemaError, match="type"):
        build({"type": "object", "properties": {"x": {"type": ["string", "null"]}}})
    with pytest.raises(UnsupportedSchemaError, match="pattern"):
        build({"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a|b)$"}}})
    with pytest.raises(UnsupportedSchemaError, match="required"):
        build({"type": "object", "properties": {}, "required": ["x"]})
    with pytest.raises(UnsupportedSchemaError, match="no integer within"):
        build({"type": "object", "properties": {"x": {"type": "integer", "minimum": 3, "maximum": 2}}})



def _string(**kw):
    return {"type": "object", "properties": {"x": {"type": "string", **kw}}}


@pytest.mark.parametrize(
    ("tools", "fragment"),
    [
        ([], "non-empty list with unique names"),
        ([{"name": "t", "parameters": {}}, {"name": "t", "parameters": {}}], "unique names"),
        ([{"name": "t", "parameters": {"type": "string"}}], "t.parameters: the arguments must be an object schema"),
        ([{"name": "t", "parameters": {"type": "object", "properties": {"x": "string"}}}],
         "t.parameters.properties.x: expected a schema object, got str"),
        ([{"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "integer", "enum": ["a"]}}}}],
         "enum/const has no value of type 'integer'"),
        ([{"name": "t", "parameters": _string(minLength=500)}], "minLength 500 > length bound"),
        ([{"name": "t", "parameters": _string(pattern="^[0-9]{5}$", maxLength=3)}], "pattern cannot match within"),
        ([{"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "array"}}}}],
         "need 'items' and minItems"),
        ([{"name": "t", "parameters": _string(pattern="^\\q+$")}], "escape \\q is not supported"),
        ([{"name": "t", "parameters": _string(pattern="^[a-z$")}], "unterminated class"),
        ([{"name": "t", "parameters": _string(pattern="^*a$")}], "without an atom"),
        ([{"name": "t", "parameters": _string(pattern="^a{2,x}$")}], "bad {n,m} quantifier"),
        ([{"name": "t", "parameters": _string(pattern="^é$")}], "outside printable ASCII"),
    ],
)  # fmt: skip
def test_every_unsupported_schema_is_named_up_front(vocab, tools, fragment):
    with pytest.raises(UnsupportedSchemaError, match=re.escape(fragment)):
        ToolCallConstraint(tools, vocab, end_id=8)


def test_constraint_settings_are_checked(vocab):
    tools = [{"name": "t", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(ValueError, match="reserved texts must start with '<'"):
        ToolCallConstraint(tools, vocab, end_id=8, reserved=("|x",))
    with pytest.raises(ValueError, match="max_int_digits"):
        Bounds(max_int_digits=0)
    with pytest.raises(ValueError, match="max_string_chars and max_array_items"):
        Bounds(max_string_chars=0)

def test_vocab_without_byte_tokens_is_refused():
    with pytest.raises(ValueError, match="single-byte tokens"):
        TokenVocab([b"a", b"b", None])


def test_masks_are_cached(tok):
    constraint = tool_call_constraint(tok)
    state = constraint.feed(constraint.initial_state(), b'{"name":"get_weather","arguments":{"city":"Pa')
    first = constraint.allowed_mask(state)
    hits = constraint.cache_hits
    assert constraint.allowed_mask(state) is first and constraint.cache_hits == hits + 1


# --------------------------------------------------------------------------------------
# The user's own tools (booleans, arrays, nested objects, enums)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 3.0, 20.0]))
def test_random_models_emit_valid_calls_of_own_tools(tok, seed, scale):
    from distillgates.data.openai_format import row_to_item

    from ..conftest import own_data_rows

    item = row_to_item(own_data_rows()[0], "rows.jsonl:1", "x")
    constraint = tool_call_constraint(tok, item["tools"])
    ids = random_decode(constraint, seed, scale)
    call = check_emitted(tok, constraint, ids, lambda c: validate_call(c, item["tools"]))
    assert call["name"] in ("create_ticket", "search_files")


def test_own_data_calls_of_every_type_are_admitted(tok):
    from distillgates.data.openai_format import row_to_item

    from ..conftest import own_data_rows

    items = [row_to_item(row, f"rows.jsonl:{i + 1}", "x") for i, row in enumerate(own_data_rows(variants=2))]
    calls = [(item, call) for item in items for call in item["expected_calls"]]
    kinds = {type(v).__name__ for _, c in calls for v in c["arguments"].values()}
    assert kinds == {"str", "bool", "list", "dict", "int"}
    for item, call in calls:
        assert_admitted(tok, tool_call_constraint(tok, item["tools"]), call)
