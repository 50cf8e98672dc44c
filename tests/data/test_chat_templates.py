"""Chat formats from real tokenizers: the toy template renders the toy format byte for byte, a ChatML /
Hermes and a Llama-3 style template render and parse through the same :class:`ChatFormat`."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from distillgates.data.chat import (
    ChatFormat,
    chat_format,
    detect_tool_call_format,
    parse_hermes_turn,
    parse_llama3_turn,
    parse_toy_turn,
    reference_messages,
    render_conversation,
    render_prompt,
    system_prompt,
    template_chat_format,
    toy_chat_format,
)
from distillgates.data.generator import generate_items
from distillgates.data.openai_format import read_items
from distillgates.data.targets import encode_item, reference_spans
from distillgates.data.tools import canonical_call
from distillgates.eval.runners import reference_output
from distillgates.tokenizer import (
    CHATML_CHAT_TEMPLATE,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)

OWN_DATA = Path(__file__).resolve().parents[2] / "examples" / "own-data"

# Written for these tests in the style of Qwen2.5's template: Hermes tool calls, ChatML turns, and the
# tools listed by the template; its turns are the library's CHATML_CHAT_TEMPLATE after the system line.
HERMES_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
) + CHATML_CHAT_TEMPLATE.split("{%- endif %}", 1)[1]  # after ChatML's own system line
# Llama 3.1 style: header turns, custom tool calls as JSON with "parameters", results in the ipython role.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{{- '{\"name\": \"' + tool_call.function.name + '\", \"parameters\": ' "
    "+ (tool_call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- else %}{{- message.content + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
HERMES_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip


def _old_toy_render(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The toy renderer as hand-written before the chat template (frozen here as the format's spec)."""
    roles = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool_result|>"}
    parts = ["<|bos|>"]
    for message in messages:
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and calls:
            turns = (f"{message['content'] if j == 0 else ''}<|tool_call|>{canonical_call(c)}<|end|>"
                     for j, c in enumerate(calls))
            parts.append("<|assistant|>" + "".join(turns))
        else:
            parts.append(f"{roles[message['role']]}{message['content']}<|end|>")
    return "".join(parts) + ("<|assistant|>" if add_generation_prompt else "")


def _all_toy_items() -> list[dict[str, Any]]:
    items = generate_items(seed=0, n=400, split="train") + generate_items(seed=1, n=200, split="eval")
    return items + read_items(OWN_DATA / "train.jsonl") + read_items(OWN_DATA / "eval.jsonl")


def _hf_tokenizer(tmp_path: Path, specials: list[str], bos: str | None, eos: str, template: str,
                  corpus: list[str]) -> PreTrainedTokenizerFast:  # fmt: skip
    """A byte-level BPE with ``specials`` trained on ``corpus``, saved with ``template`` and loaded back."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template)
    save_tokenizer(tok, tmp_path / "tok")
    return load_tokenizer(tmp_path / "tok")


@pytest.fixture(scope="module")
def own_items() -> list[dict[str, Any]]:
    return read_items(OWN_DATA / "eval.jsonl")


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, own_items) -> ChatFormat:
    corpus = [json.dumps(item["messages"]) + item["reference"] for item in own_items]
    tok = _hf_tokenizer(tmp_path_factory.mktemp("hermes"), HERMES_SPECIALS, None, "<|im_end|>", HERMES_TEMPLATE, corpus)
    return chat_format(tok)


@pytest.fixture(scope="module")
def chatml(own_items) -> ChatFormat:
    """A tokenizer trained with the library's ChatML template (what ``tokenizer.chat_template: chatml`` builds)."""
    texts = [template_chat_format("chatml").conversation(item) for item in own_items]
    return chat_format(train_tokenizer(texts, vocab_size=600, chat_template="chatml"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, own_items) -> ChatFormat:
    corpus = [json.dumps(item["messages"]) + item["reference"] for item in own_items]
    tok = _hf_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>",
                        LLAMA3_TEMPLATE, corpus)  # fmt: skip
    return chat_format(tok)


def test_toy_template_renders_the_toy_format_byte_for_byte():
    items = _all_toy_items()
    assert {item["locale"] for item in items} == {"en", "de"}
    assert any(len(item["messages"]) > 2 for item in items)  # multi-turn history
    assert any(m.get("tool_calls") for item in items for m in item["messages"])  # history with tool results
    for item in items:
        prompt = _old_toy_render(item["messages"])
        assert render_prompt(item) == prompt, item["id"]
        assert render_conversation(item) == prompt + item["reference"], item["id"]


def test_toy_generated_spans_are_the_reference_without_the_injected_results():
    fmt = toy_chat_format()
    for item in _all_toy_items():
        text, prompt = fmt.conversation(item), fmt.prompt(item)
        spans = fmt.generated_spans(item)
        assert spans[0][0] == len(prompt) and spans[-1][1] == len(text), item["id"]
        gaps = "".join(text[end:start] for (_, end), (start, _) in itertools.pairwise(spans))
        results = "".join(f"<|tool_result|>{m['content']}<|end|><|assistant|>"
                          for m in reference_messages(item["reference"]) if m["role"] == "tool")  # fmt: skip
        assert gaps == results, item["id"]


def test_a_trained_toy_tokenizer_carries_the_template_and_keeps_its_fingerprint(tmp_path):
    items = generate_items(seed=0, n=60)
    tok = train_tokenizer([render_conversation(i) for i in items], vocab_size=400)
    save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert chat_format(loaded).prompt(items[0]) == render_prompt(items[0])
    loaded.chat_template = None  # a toy tokenizer saved before the template: same fingerprint
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)
    assert chat_format(tok).stop_ids == tok.convert_tokens_to_ids(["<|end|>", "<|eos|>"])


def test_template_families_are_detected():
    assert toy_chat_format().tool_call_format == "toy"
    assert detect_tool_call_format(HERMES_TEMPLATE) == "hermes"
    assert detect_tool_call_format(LLAMA3_TEMPLATE) == "llama3"
    with pytest.raises(ValueError, match="tool_call_format"):
        detect_tool_call_format("{{ messages }}")


@pytest.mark.parametrize(("parse", "text", "calls", "answer"), [
    (parse_toy_turn, 'Sure.<|tool_call|>{"name":"a","arguments":{"x":1}}', [{"name": "a", "arguments": {"x": 1}}],
     None),
    (parse_toy_turn, '<|tool_call|>{"name":"a","argum', [None], None),
    (parse_toy_turn, "It is 3.", [], "It is 3."),
    (parse_hermes_turn, '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>',
     [{"name": "a", "arguments": {"x": 1}}], None),
    (parse_hermes_turn, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
                        '"arguments": {"q": "v"}}</tool_call>', [{"name": "a", "arguments": {}},
                                                                 {"name": "b", "arguments": {"q": "v"}}], None),
    (parse_hermes_turn, '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"',
     [{"name": "a", "arguments": {}}, None], None),
    (parse_hermes_turn, '<tool_call>{"name": "a", "parameters": {}}</tool_call>', [None], None),
    (parse_hermes_turn, "No tool needed.", [], "No tool needed."),
    (parse_llama3_turn, '{"name": "a", "parameters": {"x": 1}}', [{"name": "a", "arguments": {"x": 1}}], None),
    (parse_llama3_turn, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}',
     [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}], None),
    (parse_llama3_turn, '{"name": "a", "parameters": {"x": ', [None], None),
    (parse_llama3_turn, '{"name": "a", "arguments": {}}', [None], None),
    (parse_llama3_turn, "The answer is 4.", [], "The answer is 4."),
])  # fmt: skip
def test_tool_call_parsers(parse, text, calls, answer):
    parsed = parse(text)
    assert parsed.calls == calls and parsed.answer == answer and len(parsed.raw) == len(calls)


@pytest.mark.parametrize("family", ["hermes", "chatml", "llama3"])
def test_template_family_renders_parses_and_masks_own_data(family, request, own_items):
    fmt: ChatFormat = request.getfixturevalue(family)
    assert fmt.tool_call_format == {"chatml": "hermes"}.get(family, family)
    vocab = fmt.tokenizer.get_vocab()
    ends = {"hermes": ["<|im_end|>", "<|endoftext|>"], "chatml": ["<|im_end|>", "<|endoftext|>"],
            "llama3": ["<|eot_id|>", "<|eom_id|>"]}[family]  # fmt: skip
    assert fmt.stop_ids == [vocab[t] for t in ends]
    item = next(i for i in own_items if i.get("parallel_calls"))
    prompt, text = fmt.prompt(item), fmt.conversation(item)
    assert text.startswith(prompt) and "<|tool_call|>" not in text
    if family == "hermes":
        assert "# Tools\n<tools>" in prompt and '"create_ticket"' in prompt  # tools through apply_chat_template
    calls, answer = fmt.parse_transcript(text[len(prompt) :])
    assert calls == item["expected_calls"] and answer is not None and answer in item["reference"]
    spans = reference_spans(item, fmt)
    generated = [text[s:e] for s, e in spans["generated"]]
    assert all(g.endswith(fmt.end_of_turn) for g in generated) and len(generated) == len(calls) + 1
    assert [text[s:e] for s, e in spans["tool_name"]] == [c["name"] for c in item["expected_calls"]]
    assert [json.loads(text[s:e]) for s, e in spans["arguments"]] == [c["arguments"] for c in item["expected_calls"]]
    encoded = encode_item(fmt.tokenizer, item)
    assert encoded.input_ids == fmt.encode(text) and sum(encoded.masks["generated"]) > 0
    # the runtime's injected results are the template's rendering of the tool messages
    result = {"ticket_id": "T-1"}
    injected = fmt.tool_results_text([result])
    assert json.dumps(result, separators=(",", ":")) in injected and injected.endswith(fmt.assistant_header)
    output = reference_output(item, fmt.tokenizer)
    assert [c["call"] for c in output["calls"]] == item["expected_calls"] and output["answer"] == answer
    assert all(c["fixture_hit"] for c in output["calls"])


def test_tool_call_format_override_travels_with_the_tokenizer(tmp_path, hermes):
    tok = hermes.tokenizer
    tok.init_kwargs["tool_call_format"] = "hermes"
    save_tokenizer(tok, tmp_path / "tok")
    del tok.init_kwargs["tool_call_format"]
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["tool_call_format"] == "hermes"
    assert chat_format(load_tokenizer(tmp_path / "tok")).tool_call_format == "hermes"


def test_a_tool_call_format_whose_parser_cannot_read_the_template_is_refused(hermes):
    """The probe: a call rendered by the template must parse back with the chosen parser (Hermes tags read as
    Llama 3 give no call: every call turn would be scored, and trained, as an answer)."""
    with pytest.raises(ValueError, match=r"does not write tool calls: .*llama3 parser reads back no call"):
        ChatFormat(hermes.tokenizer, "llama3")


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tmp_path):
    backend = Tokenizer(models.BPE())
    backend.add_special_tokens(["<|x|>"])
    save_tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|x|>"), tmp_path / "tok")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template"):
        load_tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("family", ["toy", "hermes", "chatml", "llama3"])
def test_training_turn_masks_are_the_templates_generated_turns(family, request, own_items):
    """The token-level turn masks of training (header ids .. end-of-turn id) select exactly the tokens the
    template's generated spans cover (less a final eos that is not the end-of-turn token)."""
    import torch

    from distillgates.losses import turn_masks

    if family == "toy":
        texts = [template_chat_format(family).conversation(item) for item in own_items]
        fmt = chat_format(train_tokenizer(texts, vocab_size=600, chat_template=family))
    else:
        fmt = request.getfixturevalue(family)
    eos = fmt.tokenizer.eos_token_id
    for item in own_items:
        if len(item["messages"]) > 2:
            continue  # history turns in the prompt are turns too, but not generated spans
        encoded = encode_item(fmt.tokenizer, item)
        mask, start = turn_masks(torch.tensor([encoded.input_ids]), fmt.assistant_header_ids, fmt.end_of_turn_id)
        targets = {int(p) + 1 for p in mask[0].nonzero().flatten()}
        generated = {j for j, m in enumerate(encoded.masks["generated"])
                     if m and (encoded.input_ids[j] != eos or eos == fmt.end_of_turn_id)}  # fmt: skip
        assert targets == generated, item["id"]
        assert int(start.sum()) == len(item["expected_calls"]) + 1


def test_a_hermes_turn_with_parallel_calls_is_answered_call_by_call(hermes, own_items):
    """Both calls of one Hermes turn are validated and answered; their results go in together, as the
    template renders consecutive tool messages (one user turn)."""
    from distillgates.eval.runners import Conversation, Turn

    item = next(i for i in own_items if i.get("parallel_calls"))
    first, second = item["expected_calls"][:2]
    text = "".join(f'<tool_call>\n{json.dumps(c)}\n</tool_call>' for c in (first, second))
    conversation = Conversation(item, fmt=hermes)
    results = conversation.add_turn(Turn(text=text, tokens=10, stopped=True))
    assert results is not None and len(results) == 2
    assert [c["call"] for c in conversation.calls] == [first, second]
    assert all(c["fixture_hit"] and not c["errors"] for c in conversation.calls)
    injected = hermes.tool_results_text(results)
    assert injected.count("<tool_response>") == 2 and injected.count("<|im_start|>user") == 1
    assert conversation.add_turn(Turn(text="Done.", tokens=2, stopped=True)) is None and conversation.answer == "Done."


def test_ttfa_counts_a_parallel_call_turn_up_to_its_first_valid_call(hermes, own_items):
    """TTFA is the tokens generated up to the end of the first valid call's JSON, not to the end of its turn:
    in a turn of two calls it stops in the first one; an invalid first call moves it to the second. A turn
    without ids (an API teacher's) counts whole."""
    from distillgates.eval.runners import Conversation, Turn

    item = next(i for i in own_items if i.get("parallel_calls"))
    first, second = item["expected_calls"][:2]
    calls = [f'<tool_call>\n{json.dumps(c)}\n</tool_call>' for c in (first, second)]
    end = hermes.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ttfa(text: str, ids: bool = True) -> int | None:
        conversation = Conversation(item, fmt=hermes)
        conversation.tokens_out = 5  # tokens of earlier turns
        token_ids = (*hermes.encode(text), end)
        conversation.add_turn(Turn(text=text, tokens=len(token_ids), stopped=True, ids=token_ids if ids else ()))
        return conversation.ttfa

    def tokens_until(text: str, call: dict[str, Any]) -> int:  # the fewest tokens whose text holds the call's JSON
        ids = hermes.encode(text)
        return next(k for k in range(1, len(ids) + 1) if json.dumps(call) in hermes.tokenizer.decode(ids[:k]))

    both = calls[0] + calls[1]
    assert ttfa(both) == 5 + tokens_until(both, first) < 5 + len(hermes.encode(calls[0]))
    assert ttfa(both, ids=False) == 5 + len(hermes.encode(both))  # the stop token is never counted
    broken = "<tool_call>\n{not json}\n</tool_call>" + calls[1]
    assert ttfa(broken) == 5 + tokens_until(broken, second)


def test_ttfa_is_the_fewest_tokens_even_where_a_half_closing_tag_breaks_the_parse(hermes, own_items):
    """A prefix ending inside a closing tag split into several tokens ("}}\n</tool") does not parse although a
    shorter one did: the count is still the fewest tokens holding the call (a binary search over prefixes,
    which assumed a parsed call stays parsed, overshot to the tag's end on some items)."""
    from distillgates.eval.runners import Conversation, Turn

    items = [i for i in own_items if i.get("parallel_calls")]
    assert len(items) >= 5
    for item in items:
        first, second = item["expected_calls"][:2]
        text = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in (first, second))
        ids = hermes.encode(text)
        conversation = Conversation(item, fmt=hermes)
        conversation.add_turn(Turn(text=text, tokens=len(ids), stopped=False, ids=tuple(ids)))
        fewest = next(k for k in range(1, len(ids) + 1) if json.dumps(first) in hermes.tokenizer.decode(ids[:k]))
        assert conversation.ttfa == fewest, item["id"]


@pytest.mark.parametrize("family", ["toy", "hermes", "chatml", "llama3"])
def test_an_api_message_renders_as_turns_its_family_parses_back(family, request, own_items):
    """``assistant_text`` of an API's message (content, parallel calls with ids, JSON-string arguments) is
    what a model in the format generates: the toy one call per turn, the others all calls in one turn;
    the family's parser reads back the calls and the content (its ``preamble``)."""
    fmt = template_chat_format("toy") if family == "toy" else request.getfixturevalue(family)
    item = next(i for i in own_items if i.get("parallel_calls"))
    calls = item["expected_calls"][: 1 if family == "llama3" else 2]  # Llama 3 templates: one call a message
    wire = [{"id": f"c{j}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for j, c in enumerate(calls)]
    preamble = "" if family == "llama3" else "Let me do both."  # the Llama 3 template drops a call's content
    turns = fmt.split_turns(fmt.assistant_text(preamble, wire))
    assert len(turns) == (len(calls) if family == "toy" else 1)
    parsed = [fmt.parse_turn(turn) for turn in turns]
    assert [call for p in parsed for call in p.calls] == calls and parsed[0].preamble == preamble
    assert fmt.assistant_text("It is 3.") == "It is 3."
    bad = {"id": "c9", "type": "function", "function": {"name": "create_ticket", "arguments": "{not json"}}
    assert fmt.parse_turn(fmt.assistant_text(None, [bad])).calls == [None]  # an unparsable call stays one


def test_rendering_names_the_message_it_cannot_render():
    fmt = toy_chat_format()
    with pytest.raises(ValueError, match=r"messages\[1\]\.role: expected one of assistant/system/tool/user, got 'r"):
        fmt.render([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: expected a string, got int"):
        fmt.render([{"role": "user", "content": 5}])
    with pytest.raises(ValueError, match="unknown locale 'xx'"):
        system_prompt("xx")
