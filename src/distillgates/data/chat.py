"""The prompt wrapper (chat format) shared by data, teacher, training, runtime and scorer.

Rendered conversation (no newlines between segments)::

    <|bos|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>
    [preamble]<|tool_call|>{"name":...,"arguments":{...}}<|end|><|tool_result|>{result}<|end|><|assistant|>
    ... (a second call/result pair for multi items) ...
    {answer}<|end|><|eos|>

Every assistant turn starts with ``<|assistant|>``. After a tool call the *runtime* injects
:func:`tool_result_text` (``<|tool_result|>{json}<|end|><|assistant|>``) and generation goes on;
so the model generates: optional preamble, the tool call up to ``<|end|>``, and the final answer
up to ``<|end|><|eos|>``.

The system prompt depends only on the locale and lists the whole registry compactly, so every
item of a locale shares the same prefix (what the prompt cache reuses).
"""

from __future__ import annotations

import json
from typing import Any

from distillgates.config import sha256_json
from distillgates.data.registry import TOOLS, canonical_call, parse_tool_call
from distillgates.tokenizer import (
    ASSISTANT,
    BOS,
    END,
    EOS,
    SPECIAL_TOKENS,
    SYSTEM,
    TOOL_CALL,
    TOOL_RESULT,
    USER,
)

PROMPT_WRAPPER_VERSION = "1"

_SYSTEM_INTRO = {
    "en": "You are a helpful assistant. Never repeat personal data. Tools: ",
    "de": "Du bist ein hilfreicher Assistent. Gib keine persönlichen Daten wieder. Tools: ",
}
LOCALES = tuple(_SYSTEM_INTRO)
_ROLE_TOKENS = {"system": SYSTEM, "user": USER}
_TYPE_ABBREV = {"number": "num", "integer": "int", "string": ""}


def _compact_param(name: str, schema: dict[str, Any], required: bool) -> str:
    text = name if required else f"{name}?"
    abbrev = _TYPE_ABBREV[schema["type"]]
    return f"{text}:{abbrev}" if abbrev else text


def compact_tool_list() -> str:
    """``get_weather(city,unit?);convert_currency(amount:num,...);...`` - the registry in few tokens."""
    parts = []
    for tool in TOOLS:
        params = tool["parameters"]
        args = [_compact_param(n, s, n in params["required"]) for n, s in params["properties"].items()]
        parts.append(f"{tool['name']}({','.join(args)})")
    return ";".join(parts)


def system_prompt(locale: str) -> str:
    """The system prompt of ``locale`` (identical for every item of that locale).

    Raises:
        ValueError: for an unknown locale.
    """
    if locale not in _SYSTEM_INTRO:
        raise ValueError(f"unknown locale {locale!r}, expected one of {LOCALES}")
    return _SYSTEM_INTRO[locale] + compact_tool_list()


def render_prompt(item: dict[str, Any]) -> str:
    """The prompt text of ``item`` up to and including the first ``<|assistant|>``."""
    parts = [BOS]
    for message in item["messages"]:
        role = message["role"]
        if role not in _ROLE_TOKENS:
            raise ValueError(f"item {item.get('id')}: prompt message role must be system/user, got {role!r}")
        parts.append(f"{_ROLE_TOKENS[role]}{message['content']}{END}")
    parts.append(ASSISTANT)
    return "".join(parts)


def render_conversation(item: dict[str, Any]) -> str:
    """The full reference conversation: prompt + reference assistant text."""
    return render_prompt(item) + item["reference"]


def tool_call_text(call: dict[str, Any], preamble: str = "") -> str:
    """One generated tool-call turn (after ``<|assistant|>``): ``preamble<|tool_call|>{json}<|end|>``."""
    return f"{preamble}{TOOL_CALL}{canonical_call(call)}{END}"


def tool_result_text(result: dict[str, Any]) -> str:
    """What the runtime injects after a tool call: ``<|tool_result|>{json}<|end|><|assistant|>``."""
    return f"{TOOL_RESULT}{json.dumps(result, separators=(',', ':'), ensure_ascii=False)}{END}{ASSISTANT}"


def answer_text(answer: str) -> str:
    """The final generated answer turn: ``answer<|end|><|eos|>``."""
    return f"{answer}{END}{EOS}"


def parse_assistant_turn(text: str) -> dict[str, Any] | str | None:
    """Parse one generated assistant turn (the text after ``<|assistant|>``).

    Returns:
        the tool-call dict if the turn contains ``<|tool_call|>`` and its JSON parses
        (a preamble before it is ignored); ``None`` if it contains ``<|tool_call|>`` but the
        JSON does not parse; otherwise the answer text (without ``<|end|>``/``<|eos|>``).
    """
    if TOOL_CALL in text:
        body = text.split(TOOL_CALL, 1)[1].split(END, 1)[0]
        return parse_tool_call(body)
    return text.split(END, 1)[0].replace(EOS, "")


def parse_transcript(text: str) -> tuple[list[dict[str, Any] | None], str | None]:
    """Split a generated transcript (a reference, or what a runtime produced after the prompt).

    Returns:
        (calls in order, ``None`` for each that did not parse; the final answer text or ``None``
        when the transcript ends without one).
    """
    calls: list[dict[str, Any] | None] = []
    answer = None
    for turn in text.split(ASSISTANT):
        turn = turn.split(TOOL_RESULT, 1)[0]  # a tool result belongs to the runtime, not the model
        if not turn:
            continue
        parsed = parse_assistant_turn(turn)
        if isinstance(parsed, str):
            answer = parsed
        else:
            calls.append(parsed)
    return calls, answer


def prompt_wrapper_sha256() -> str:
    """sha256 over everything that defines the rendered text: version, specials, system prompts."""
    return sha256_json(
        {
            "version": PROMPT_WRAPPER_VERSION,
            "special_tokens": list(SPECIAL_TOKENS),
            "system_prompts": {loc: system_prompt(loc) for loc in LOCALES},
            "layout": [
                render_prompt({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}),
                tool_call_text({"name": "n", "arguments": {}}, "P"),
                tool_result_text({}),
                answer_text("A"),
            ],
        }
    )
