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

The system prompt lists the item's tools compactly (the whole toy registry for a toy item), so
every toy item of a locale shares the same prefix (what the prompt cache reuses). Earlier turns
of a multi-turn conversation are part of the prompt (:func:`render_messages`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from distillgates.config import sha256_json
from distillgates.data.registry import TOOLS
from distillgates.data.tools import canonical_call, item_tools, parse_tool_call
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
_ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL_RESULT}
# compact type names; a string parameter (the common case) shows no type at all
_TYPE_ABBREV = {"number": "num", "integer": "int", "string": "", "boolean": "bool", "array": "list",
                "object": "obj", "null": "null"}


def _compact_param(name: str, schema: Mapping[str, Any], required: bool) -> str:
    text = name if required else f"{name}?"
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):  # ["string", "null"]: the first non-null type names it
        kind = next((k for k in kind if k != "null"), "null")
    abbrev = _TYPE_ABBREV.get(kind, "any") if isinstance(kind, str) else "any"
    return f"{text}:{abbrev}" if abbrev else text


def compact_tool_list(tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``get_weather(city,unit?);convert_currency(amount:num,...);...`` - ``tools`` in few tokens.

    ``tools``: OpenAI function format (default: the toy registry). Every JSON Schema type has a
    short name (``bool``, ``list``, ``obj``...; ``any`` for a schema without one type).
    """
    parts = []
    for tool in TOOLS if tools is None else tools:
        params = tool.get("parameters") or {}
        required = set(params.get("required", []))
        args = [_compact_param(n, s, n in required) for n, s in params.get("properties", {}).items()]
        parts.append(f"{tool['name']}({','.join(args)})")
    return ";".join(parts)


def system_prompt(locale: str, tools: Sequence[Mapping[str, Any]] | None = None, intro: str | None = None) -> str:
    """The system prompt: the locale's intro (or the dataset's own ``intro``) and the compact tool list.

    Every toy item of a locale shares it (the prefix the prompt cache reuses).

    Raises:
        ValueError: for an unknown locale.
    """
    if locale not in _SYSTEM_INTRO:
        raise ValueError(f"unknown locale {locale!r}, expected one of {LOCALES}")
    if intro is None:
        return _SYSTEM_INTRO[locale] + compact_tool_list(tools)
    return f"{intro} Tools: {compact_tool_list(tools)}"


def item_system_prompt(item: Mapping[str, Any]) -> str:
    """The system prompt of ``item``: its tools (:func:`item_tools`), its own ``instructions`` if any."""
    return system_prompt(str(item.get("locale", "en")), item_tools(item), item.get("instructions"))


def render_messages(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Chat-format text of messages (roles system/user/assistant/tool), THE renderer of a prompt.

    An assistant message renders as ``<|assistant|>{content}<|end|>``, or, with ``tool_calls`` (one
    call per message: parallel calls are interleaved with their results by the data reader), as
    ``<|assistant|>{content}<|tool_call|>{json}<|end|>``; a ``tool`` message as
    ``<|tool_result|>{content}<|end|>``. With ``add_generation_prompt`` a final ``<|assistant|>`` opens
    the turn to generate. (A tokenizer's own chat template would take this function's place.)

    Raises:
        ValueError: on an unknown role or a non-string content, naming the message index.
    """
    parts = [BOS]
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in _ROLE_TOKENS:
            raise ValueError(f"messages[{i}].role: expected one of {sorted(_ROLE_TOKENS)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            parts.append(ASSISTANT + "".join(tool_call_text(c, content if j == 0 else "") for j, c in enumerate(calls)))
        else:
            parts.append(f"{_ROLE_TOKENS[role]}{content}{END}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)


def render_prompt(item: Mapping[str, Any]) -> str:
    """The prompt text of ``item`` up to and including the ``<|assistant|>`` that opens the turn to generate."""
    return render_messages(item["messages"])


def render_conversation(item: Mapping[str, Any]) -> str:
    """The full reference conversation: prompt + reference assistant text."""
    return render_prompt(item) + item["reference"]


def tool_call_text(call: Mapping[str, Any], preamble: str = "") -> str:
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
