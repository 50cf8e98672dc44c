"""Process-step targets: character spans of the rendered reference mapped to token masks.

Span kinds of :func:`reference_spans` (character ranges ``[start, end)`` of the reference
conversation rendered by the chat format, :meth:`~distillgates.data.chat.ChatFormat.conversation`):

- ``tool_name``: the tool name string inside each call JSON (without quotes);
- ``arguments``: each call's arguments object, braces included;
- ``argument_values``: each argument value (strings without their quotes, numbers as written);
- ``integration``: each integration field where it occurs in the final answer;
- ``generated``: everything the model generates: the assistant turns of the rendered template after
  the prompt (:meth:`~distillgates.data.chat.ChatFormat.generated_spans`; toy: preamble + call +
  ``<|end|>``, the final answer + ``<|end|><|eos|>``), not the tool results the runtime injects.

Mask definition: a token is under a span's mask iff its character offsets **overlap** the span.
Byte-level BPE tokens need not start or end where a span does (``":"Paris`` may merge), so an
exact-boundary definition would drop tokens or be impossible; with overlap, the masked run
decodes to the span text plus at most the rest of its first and last tokens (the property test
checks the span is contained in it and that no masked token lies outside the span).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerFast

from distillgates.data.chat import ChatFormat, chat_format, toy_chat_format

Span = tuple[int, int]
SPAN_KINDS = ("tool_name", "arguments", "argument_values", "integration", "generated")


_DECODER = json.JSONDecoder()


def _find(text: str, needle: str, start: int) -> int:
    pos = text.find(needle, start)
    if pos < 0:
        raise ValueError(f"{needle!r} not found in the rendered text after position {start}")
    return pos


def _value_span(text: str, key: str, start: int) -> Span:
    """Span of the JSON value of the first ``"key":`` at or after ``start`` (any whitespace around ``:``)."""
    at = _find(text, json.dumps(key, ensure_ascii=False), start) + len(json.dumps(key, ensure_ascii=False))
    while text[at].isspace():
        at += 1
    if text[at] != ":":
        raise ValueError(f"no ':' after key {key!r} at position {at}")
    at += 1
    while text[at].isspace():
        at += 1
    _, end = _DECODER.raw_decode(text, at)
    return at, end


def _call_spans(text: str, call: dict[str, Any], at: int, spans: dict[str, list[Span]]) -> int:
    """Spans of one call JSON (``{"name": ..., "arguments"|"parameters": {...}}``) starting at ``at``; returns
    the end of its arguments object."""
    name_start, name_end = _value_span(text, "name", at)
    if text[name_start + 1 : name_end - 1] != call["name"]:
        raise ValueError(f"call name {call['name']!r} not at position {name_start}")
    spans["tool_name"].append((name_start + 1, name_end - 1))
    keys = [k for k in ("arguments", "parameters") if text.find(f'"{k}"', name_end) >= 0]
    key = min(keys, key=lambda k: text.find(f'"{k}"', name_end))
    args_start, args_end = _value_span(text, key, name_end)
    spans["arguments"].append((args_start, args_end))
    cursor = args_start
    for name, value in call["arguments"].items():
        start, cursor = _value_span(text, name, cursor)
        string = isinstance(value, str)
        spans["argument_values"].append((start + 1, cursor - 1) if string else (start, cursor))
    return args_end


def reference_spans(item: dict[str, Any], fmt: ChatFormat | None = None) -> dict[str, list[Span]]:
    """Character spans (see module doc) of ``fmt.conversation(item)`` (default: the toy format)."""
    fmt = fmt or toy_chat_format()
    text = fmt.conversation(item)
    spans: dict[str, list[Span]] = {kind: [] for kind in SPAN_KINDS}
    spans["generated"] = fmt.generated_spans(item)
    cursor = spans["generated"][0][0]
    for call in item["expected_calls"]:
        call_at = _find(text, '{"name"', cursor)
        if not any(start <= call_at < end for start, end in spans["generated"]):
            raise ValueError(f"item {item.get('id')}: call {call['name']!r} not inside a generated turn")
        cursor = _call_spans(text, call, call_at, spans)
    answer_start = spans["generated"][-1][0]
    for value in item["integration_fields"]:
        at = find_value(text, value, answer_start)
        if at < 0:
            raise ValueError(f"{value!r} not found in the rendered text after position {answer_start}")
        spans["integration"].append((at, at + len(value)))
    return spans


def find_value(text: str, value: str, start: int = 0) -> int:
    """Where ``value`` (an integration field) first occurs in ``text`` at or after ``start`` (-1: nowhere),
    preferring a whole-token occurrence: "2" should not match inside a date "2025-02-03"."""
    bounded = re.compile(rf"(?<![\w.]){re.escape(value)}(?!\w|\.\d)").search(text, start)
    return bounded.start() if bounded else text.find(value, start)


def process_masks(
    tokenizer: PreTrainedTokenizerFast, text: str, spans: dict[str, list[Span]]
) -> tuple[list[int], dict[str, list[bool]]]:
    """Token ids of ``text`` and, per span kind, a mask of the tokens overlapping any span.

    Returns:
        (input_ids of length T, {kind: [bool] * T}).
    """
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets: list[tuple[int, int]] = encoding["offset_mapping"]
    masks = {}
    for kind, ranges in spans.items():
        masks[kind] = [any(s < b and e > a for a, b in ranges) for s, e in offsets]
    return list(encoding["input_ids"]), masks


@dataclass
class EncodedItem:
    """A reference conversation as token ids with its process-step masks."""

    input_ids: list[int]  # (T,)
    masks: dict[str, list[bool]]  # kind -> (T,)
    prompt_len: int  # tokens of render_prompt(item) (prefix of input_ids)


def encode_item(tokenizer: PreTrainedTokenizerFast, item: dict[str, Any]) -> EncodedItem:
    """Encode the reference conversation of ``item`` in the tokenizer's chat format with all process masks."""
    fmt = chat_format(tokenizer)
    input_ids, masks = process_masks(tokenizer, fmt.conversation(item), reference_spans(item, fmt))
    prompt_len = len(tokenizer.encode(fmt.prompt(item), add_special_tokens=False))
    return EncodedItem(input_ids, masks, prompt_len)
