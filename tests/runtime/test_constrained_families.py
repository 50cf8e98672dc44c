"""Constrained tool-call decoding in every chat family's own call syntax: Hermes/ChatML ``<tool_call>`` (one
special token, or several ordinary ones) with spaced JSON and parallel calls, Llama 3 ``<|python_tag|>`` with
``parameters``. Every constrained turn parses with the family's parser, validates against the item's tools
and is exactly the template's own rendering of those calls; the tokenizer's encoding of that rendering is
admitted token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distillgates.data.chat import CallSyntax, ChatFormat, chat_format, template_chat_format
from distillgates.data.openai_format import read_items
from distillgates.data.tools import item_tools, validate_call
from distillgates.runtime.constrained import (
    AFTER,
    CALL,
    FREE,
    ConstraintViolation,
    TokenVocab,
    ToolCallConstraint,
    TurnConstraint,
    tool_call_constraint,
    tool_call_processor,
)
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.tokenizer import train_tokenizer

from ..data.test_chat_templates import (
    HERMES_SPECIALS,
    HERMES_TEMPLATE,
    LLAMA3_SPECIALS,
    LLAMA3_TEMPLATE,
    _hf_tokenizer,
)

OWN_DATA = Path(__file__).resolve().parents[2] / "examples" / "own-data"
MAX_TOKENS = 3000  # far above any bounded turn; reaching it means the constraint did not terminate
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def own_items() -> list[dict[str, Any]]:
    return read_items(OWN_DATA / "train.jsonl")[:120]


@pytest.fixture(scope="module")
def chatml(own_items) -> ChatFormat:
    """The library's ChatML template: ``<tool_call>`` and ``</tool_call>`` are single special tokens."""
    texts = [template_chat_format("chatml").conversation(item) for item in own_items]
    return chat_format(train_tokenizer(texts, vocab_size=700, chat_template="chatml"))


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, own_items) -> ChatFormat:
    """A Qwen-style Hermes template over a byte-level BPE without tool tags: ``<tool_call>`` is several tokens."""
    corpus = [template_chat_format("chatml").conversation(item) for item in own_items]
    tok = _hf_tokenizer(tmp_path_factory.mktemp("hermes"), HERMES_SPECIALS, None, "<|im_end|>", HERMES_TEMPLATE,
                        corpus)  # fmt: skip
    return chat_format(tok)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, own_items) -> ChatFormat:
    corpus = [template_chat_format("chatml").conversation(item) for item in own_items]
    tok = _hf_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>",
                        LLAMA3_TEMPLATE, corpus)  # fmt: skip
    return chat_format(tok)


def tools_of(own_items) -> list[dict[str, Any]]:
    return item_tools(own_items[0])


def test_call_syntax_is_read_off_each_template(chatml, hermes, llama3):
    toy = template_chat_format("toy").call_syntax
    assert toy == CallSyntax("<|tool_call|>", "", "", None, "arguments", spaced=False)
    assert toy.reserved == ("<|",)
    for fmt in (chatml, hermes):
        assert fmt.call_syntax == CallSyntax("<tool_call>", "\n", "\n</tool_call>", "\n", "arguments", spaced=True)
        assert fmt.call_syntax.reserved == ("<|", "<tool_call>", "</tool_call>")
    # the template writes a bare JSON turn, one call: that, or <|python_tag|> + the JSON
    assert llama3.call_syntax == CallSyntax("<|python_tag|>", "", "", None, "parameters", True, opens_turn=True)
    assert len(hermes.encode("<tool_call>")) > 1 and len(chatml.encode("<tool_call>")) == 1


def random_turn(fmt: ChatFormat, processor, seed: int, scale: float, preamble: str = "",
                opener: str | None = None) -> list[int]:  # fmt: skip
    """A random "model" writes ``preamble`` and ``opener`` (default: the family's trigger) token by token
    through the processor, each token allowed, then greedy over masked random logits until the end-of-turn
    token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(fmt.tokenizer)
    ids: list[int] = []
    for token in fmt.encode(preamble + (fmt.call_syntax.trigger if opener is None else opener)):
        assert torch.isfinite(processor(ids, torch.zeros(vocab))[token]), (fmt.tokenizer.decode(ids), token)
        ids.append(token)
    for _ in range(MAX_TOKENS):
        token = int(processor(ids, torch.randn(vocab, generator=gen) * scale).argmax())
        ids.append(token)
        if token == fmt.end_of_turn_id:
            return ids
    raise AssertionError(f"constrained decoding did not end the turn in {MAX_TOKENS} tokens")


def check_turn(fmt: ChatFormat, ids: list[int], tools: list[dict[str, Any]], preamble: str = "") -> list[dict]:
    """The turn parses with the family's parser, every call validates, and the text is the template's own
    rendering of those calls."""
    assert ids[-1] == fmt.end_of_turn_id
    text = fmt.tokenizer.decode(ids[:-1], skip_special_tokens=False)
    parsed = fmt.parse_turn(text)
    assert parsed.answer is None and parsed.calls and None not in parsed.calls, text
    calls: list[dict] = parsed.calls  # type: ignore[assignment]
    for call in calls:
        assert validate_call(call, tools) == [], (call, text)
    assert text == preamble + fmt.assistant_text("", calls).lstrip(), text  # exactly what the template writes
    return calls


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 3.0, 20.0]))
def test_random_models_emit_parsable_valid_hermes_calls(chatml, hermes, own_items, seed, scale):
    tools = tools_of(own_items)
    for fmt in (chatml, hermes):
        processor = tool_call_processor(fmt.tokenizer, tools)
        check_turn(fmt, random_turn(fmt, processor, seed, scale), tools)


def test_parallel_calls_and_every_schema_type(chatml, hermes, own_items):
    """Over many random turns: parallel calls occur, and booleans, arrays, nested objects, enums and integers
    are all emitted valid."""
    tools = tools_of(own_items)
    for fmt in (chatml, hermes):
        counts, kinds = [], set()
        for seed in range(30):
            processor = tool_call_processor(fmt.tokenizer, tools)
            calls = check_turn(fmt, random_turn(fmt, processor, seed, 3.0, preamble="On it. "), tools, "On it. ")
            counts.append(len(calls))
            kinds |= {type(v).__name__ for c in calls for v in c["arguments"].values()}
        assert max(counts) >= 2 and min(counts) == 1, counts
        assert kinds == {"str", "bool", "list", "dict", "int"}, kinds


def test_llama3_bare_json_and_python_tag_calls(llama3, own_items):
    """A Llama 3 turn that opens with "{" is one constrained call, as is one after <|python_tag|>; a turn that
    opens with text is free."""
    tools = tools_of(own_items)
    for seed in range(6):
        processor = tool_call_processor(llama3.tokenizer, tools)
        ids = random_turn(llama3, processor, seed, 3.0, opener="<|python_tag|>" if seed % 2 else " {")
        text = llama3.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        [call] = llama3.parse_turn(text).calls
        assert call is not None and validate_call(call, tools) == [], text
        assert text.lstrip().removeprefix("<|python_tag|>") == llama3.call_text(call)
    processor = tool_call_processor(llama3.tokenizer, tools)
    logits = torch.randn(len(llama3.tokenizer))
    assert torch.equal(processor(llama3.encode("It is"), logits), logits)  # an answer: free


def test_the_templates_own_rendering_is_admitted(chatml, hermes, own_items):
    """The tokenizer's encoding of every expected call turn of the dataset (parallel ones too), after a
    preamble, passes the mask token by token and ends on the end-of-turn token."""
    for fmt in (chatml, hermes):
        turns = 0
        for item in own_items[:60]:
            for turn in fmt_turns(item):
                ids = [*fmt.encode("Sure. " + fmt.assistant_text("", turn).lstrip()), fmt.end_of_turn_id]
                processor = tool_call_processor(fmt.tokenizer, item_tools(item))
                for i, token in enumerate(ids):
                    allowed = processor(ids[:i], torch.zeros(len(fmt.tokenizer)))
                    assert torch.isfinite(allowed[token]), (fmt.tokenizer.decode(ids[: i + 1]), i)
                assert processor.state(ids) == (FREE, 0)
                turns += 1
        assert turns > 30


def fmt_turns(item: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The expected calls of ``item`` grouped by assistant turn (parallel calls share one)."""
    from distillgates.data.chat import reference_messages

    return [m["tool_calls"] for m in reference_messages(item["reference"]) if m.get("tool_calls")] or [
        [c] for c in item["expected_calls"]]  # fmt: skip


def test_reserved_texts_never_appear_in_strings(hermes, own_items):
    constraint = tool_call_constraint(hermes.tokenizer, tools_of(own_items))
    start = '{"name": "search_files", "arguments": {"query": "a'
    feed = lambda text: constraint.feed(constraint.initial_state(), (start + text).encode())  # noqa: E731
    assert feed("</tool_call") is not None and feed("</tool_call>") is None  # would end the call for the parser
    assert feed("<tool_call>") is None and feed("<|") is None and feed("<b>") is not None
    assert constraint.feed(constraint.initial_state(), b'{"name":"search_files"') is None  # spaced, as the template


def test_a_token_that_finishes_the_trigger_must_go_on_validly():
    """Free text is masked only where a token would finish the trigger and continue wrongly."""
    single = [bytes([b]) for b in range(256)]
    extra = [b"<tool_call", b">\n{", b">x", b"ok<tool_call>\n", b"}\n</", b"}\nx"]
    vocab = TokenVocab([*single, *extra, None], special_bytes={262: b"<|im_end|>"})
    ids = {t: 256 + i for i, t in enumerate(extra)}
    tools = [{"name": "t", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
    syntax = CallSyntax("<tool_call>", "\n", "\n</tool_call>", "\n", "arguments", spaced=True)
    constraint = ToolCallConstraint(tools, vocab, 262, spaced=True, reserved=syntax.reserved)
    turn = TurnConstraint(constraint, syntax, end_of_turn_id=262)
    assert turn.allowed_mask((FREE, 0)) is None  # "ok<tool_call>\n" finishes the trigger validly: nothing masked
    state = turn.advance((FREE, 0), ids[b"<tool_call"])
    mask = turn.allowed_mask(state)
    assert mask is not None and mask[ids[b">\n{"]] and mask[ord(">")] and not mask[ids[b">x"]]
    assert mask.sum() == vocab.size - 1
    state = turn.advance(state, ids[b">\n{"])
    assert state[0] == CALL
    for token in b'"name": "t", "arguments": {}':
        state = turn.advance(state, token)
    mask = turn.allowed_mask(state)  # "}\n</" closes the call and goes on into the closer
    assert mask is not None and mask[ids[b"}\n</"]] and mask[ord("}")] and not mask[ids[b"}\nx"]]
    for token in [ids[b"}\n</"], *b"tool_call>"]:
        state = turn.advance(state, token)
    assert state == (AFTER, 0)
    mask = turn.allowed_mask(state)  # end the turn or start the next call
    assert mask is not None and sorted(torch.nonzero(mask).flatten().tolist()) == [ord("\n"), 262]
    with pytest.raises(ConstraintViolation, match="not allowed"):
        turn.advance(state, ord("x"))
    assert turn.advance(state, 262) == (FREE, 0)


def test_engine_generates_parsable_calls_under_the_constraint(chatml, hermes, own_items, make_model):
    """Random tiny models on the runtime engine, prompted up to the trigger (a forced call): every turn is
    valid calls in the family's syntax; the same models unconstrained write none."""
    tools = tools_of(own_items)
    item = {**own_items[0], "messages": [m for m in own_items[0]["messages"] if m["role"] != "system"]}
    for fmt in (chatml, hermes):
        trigger = fmt.call_syntax.trigger
        prompt = fmt.encode(fmt.prompt(item) + trigger)
        for seed in range(3):
            engine = TorchEngine(make_model(seed, vocab_size=len(fmt.tokenizer), max_seq_len=2048))
            processor = tool_call_processor(fmt.tokenizer, tools, prompt_opens_call=True)
            out = list(engine.generate(prompt, max_new_tokens=1500, stop_ids=fmt.stop_ids, logits_processor=processor))
            text = fmt.tokenizer.decode(fmt.encode(trigger) + out[:-1], skip_special_tokens=False)
            check_turn(fmt, [*fmt.encode(trigger), *out], tools)
            free = list(engine.generate(prompt, max_new_tokens=60, stop_ids=fmt.stop_ids))
            free_text = fmt.tokenizer.decode(fmt.encode(trigger) + free, skip_special_tokens=False)
            assert not any(c is not None and not validate_call(c, tools) for c in fmt.parse_turn(free_text).calls)
            assert text.startswith(trigger)


def test_eval_runner_decodes_chatml_calls_under_the_constraint(chatml):
    """The eval runner with ``constrained`` on a ChatML tokenizer (main refused it: "tokenizer has no
    <|tool_call|> token"): a model steered to always want ``<tool_call>`` writes no valid call freely and
    only valid calls of each item's own tools under the constraint."""
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.runners import EngineRunner
    from distillgates.model import Transformer

    from ..conftest import tiny_model_config

    items = [i for i in read_items(OWN_DATA / "eval.jsonl") if i["expected_calls"]][:4]
    tok = chatml.tokenizer
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=len(tok), n_layers=1, n_heads=2, n_kv_heads=1,
                                          max_seq_len=1024)).eval()  # fmt: skip
    with torch.no_grad():  # residual channel 0 is 1 for every token; the tied head reads it as <tool_call>
        for layer in model.layers:
            layer.attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.embed.weight[:, 0] = 1.0
        model.embed.weight[tok.convert_tokens_to_ids("<tool_call>"), 0] = 200.0
    results = {}
    for constrained in (False, True):
        runner = EngineRunner(TorchEngine(model), tok, "m" * 64, 400, constrained=constrained)
        results[constrained] = evaluate(runner, items, tok, max_calls=2, return_outputs=True)
    assert results[False][0]["json_validity"] == 0.0
    metrics, outputs, _ = results[True]
    assert metrics["json_validity"] == 1.0
    calls = [(item, c["call"]) for item, o in zip(items, outputs, strict=True) for c in o["calls"]]
    assert calls and all(not validate_call(call, item_tools(item)) for item, call in calls)
    assert not any("unconstrained_reason" in o for o in outputs)


def test_a_turn_that_opens_with_a_brace_is_a_call():
    """Llama 3: at a turn's start a token that opens with "{" (after blanks) must start a valid call."""
    single = [bytes([b]) for b in range(256)]
    extra = [b'{"', b"{}", b" {", b"\n{x", b"Hi"]
    vocab = TokenVocab([*single, *extra, None], special_bytes={261: b"<|eot_id|>"})
    ids = {t: 256 + i for i, t in enumerate(extra)}
    tools = [{"name": "t", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
    syntax = CallSyntax("", "", "", None, "parameters", spaced=True, opens_turn=True)
    constraint = ToolCallConstraint(tools, vocab, 261, arguments_key="parameters", spaced=True)
    turn = TurnConstraint(constraint, syntax, end_of_turn_id=261)
    start = turn.initial_state()
    mask = turn.allowed_mask(start)
    assert mask is not None and mask[ids[b'{"']] and mask[ids[b" {"]] and mask[ids[b"Hi"]] and mask[ord("{")]
    assert not mask[ids[b"{}"]] and not mask[ids[b"\n{x"]] and mask.sum() == vocab.size - 2
    assert turn.allowed_mask(turn.advance(start, ids[b"Hi"])) is None  # an answer: free, "{" later is text
    state = turn.advance(start, ids[b" {"])
    for token in b'"name": "t", "parameters": {"a": 7}}':
        state = turn.advance(state, token)
    assert state == (AFTER, 0) and torch.nonzero(turn.allowed_mask(state)).flatten().tolist() == [261]
