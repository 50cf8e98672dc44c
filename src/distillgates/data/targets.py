"""Process-step targets: character spans of the rendered reference mapped to token masks.

Span kinds of :func:`reference_spans` (character ranges ``[start, end)`` of
``render_conversation(item)``):

- ``tool_name``: the tool name string inside each call JSON (without quotes);
- ``arguments``: each call's arguments object, braces included;
- ``argument_values``: each argument value (strings without their quotes, numbers as written);
- ``integration``: each integration field where it occurs in the final answer;
- ``generated``: everything the model generates (preamble + call + ``<|end|>``; the final answer +
  ``<|end|><|eos|>``), i.e. not the prompt and not the tool results the runtime injects.

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

from distillgates.data.chat import render_conversation, render_prompt
from distillgates.data.tools import canonical_call
from distillgates.tokenizer import ASSISTANT, END, EOS, TOOL_CALL, TOOL_RESULT

Span = tuple[int, int]
SPAN_KINDS = ("tool_name", "arguments", "argument_values", "integration", "generated")


def _find(text: str, needle: str, start: int) -> int:
    pos = text.find(needle, start)
    if pos < 0:
        raise ValueError(f"{needle!r} not found in the rendered text after position {start}")
    return pos


def _call_spans(text: str, call: dict[str, Any], at: int, spans: dict[str, list[Span]]) -> int:
    """Spans of one canonical call JSON starting at ``at``; returns its end."""
    json_text = canonical_call(call)
    if text[at : at + len(json_text)] != json_text:
        raise ValueError(f"call JSON {json_text!r} not at position {at}")
    name_at = at + len('{"name":"')
    spans["tool_name"].append((name_at, name_at + len(call["name"])))
    args_at = at + len(json_text) - len(json.dumps(call["arguments"], separators=(",", ":"), ensure_ascii=False)) - 1
    spans["arguments"].append((args_at, at + len(json_text) - 1))
    cursor = args_at
    for key, value in call["arguments"].items():
        cursor = _find(text, json.dumps(key, ensure_ascii=False) + ":", cursor) + len(json.dumps(key)) + 1
        value_text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if isinstance(value, str):
            spans["argument_values"].append((cursor + 1, cursor + len(value_text) - 1))
        else:
            spans["argument_values"].append((cursor, cursor + len(value_text)))
        cursor += len(value_text)
    return at + len(json_text)


def reference_spans(item: dict[str, Any]) -> dict[str, list[Span]]:
    """Character spans (see module doc) of ``render_conversation(item)``."""
    text = render_conversation(item)
    spans: dict[str, list[Span]] = {kind: [] for kind in SPAN_KINDS}
    cursor = len(render_prompt(item))
    turn_start = cursor
    for call in item["expected_calls"]:
        call_at = _find(text, TOOL_CALL, cursor) + len(TOOL_CALL)
        cursor = _call_spans(text, call, call_at, spans)
        spans["generated"].append((turn_start, cursor + len(END)))
        result_at = _find(text, TOOL_RESULT, cursor)
        turn_start = cursor = _find(text, END + ASSISTANT, result_at) + len(END + ASSISTANT)
    spans["generated"].append((turn_start, len(text)))
    if not text.endswith(END + EOS):
        raise ValueError(f"item {item.get('id')}: reference must end with {END}{EOS}")
    for value in item["integration_fields"]:
        # Prefer a whole-token occurrence: "2" should not match inside a date "2025-02-03".
        bounded = re.compile(rf"(?<![\w.]){re.escape(value)}(?!\w|\.\d)").search(text, turn_start)
        at = bounded.start() if bounded else _find(text, value, turn_start)
        spans["integration"].append((at, at + len(value)))
    return spans


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
    """Encode ``render_conversation(item)`` with all process masks."""
    input_ids, masks = process_masks(tokenizer, render_conversation(item), reference_spans(item))
    prompt_len = len(tokenizer.encode(render_prompt(item), add_special_tokens=False))
    return EncodedItem(input_ids, masks, prompt_len)
