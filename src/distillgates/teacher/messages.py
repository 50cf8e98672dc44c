"""Conversations as the OpenAI chat-completions API takes them, and back.

The project keeps a conversation in the renderer's form (:meth:`distillgates.data.chat.ChatFormat.render`):
``content`` always a string, an assistant call as ``tool_calls: [{"name", "arguments": {...}}]`` (one
call per message where the data reader interleaved parallel calls with their results), ``tool``
messages without ids. An OpenAI-compatible API wants real chat messages::

    {"role": "assistant", "content": null | str,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\\"city\\":\\"Paris\\"}"}}, ...]}
    {"role": "tool", "tool_call_id": "call_1", "content": "{...}"}

:func:`openai_messages` converts one way (the HTTP teacher's request), :func:`chat_messages` the
other (the loopback server's prompt). :func:`call_turns` and :func:`turn_messages` are how the KD
builder and the eval loop's teacher session play one response (parallel calls included). A call
keeps the ``id`` the API gave it (stored on the call and as ``tool_call_id`` on its result); a call
from the item's history, or one a model wrote as text in its chat format (a server that returned
it as ``content``), gets ``call_<message index>``. Calls written as text are found by the chat
format's parser (:class:`~distillgates.data.chat.ChatFormat`; the toy's by default): nothing here
knows a format's markup.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from distillgates.data.chat import ChatFormat, call_arguments, toy_chat_format
from distillgates.teacher.base import TurnResult


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _text_calls(content: str, fmt: ChatFormat) -> list[dict[str, Any]]:
    """The calls a model wrote as text in ``content`` (its chat format); an unparsable one has no name
    and its raw text as arguments."""
    parsed = fmt.parse_turn(content)
    return [call or {"name": "", "arguments": raw} for call, raw in zip(parsed.calls, parsed.raw, strict=True)]


def openai_messages(messages: Sequence[Mapping[str, Any]], fmt: ChatFormat | None = None) -> list[dict[str, Any]]:
    """The renderer's messages as OpenAI chat messages (module docstring).

    A ``tool`` message without ``tool_call_id`` answers the oldest call of the assistant message
    before it that is not answered yet (the data reader's and the eval loop's order). An assistant
    message that tool results follow and whose ``content`` holds calls written as text in ``fmt``
    (default: the toy's) keeps that text as its content and gets those calls as ``tool_calls`` too,
    so its results answer ids; a call that does not parse has an empty name and its raw text as
    arguments. (Only then: an answer that merely looks like a call, a Llama 3 answer opening with
    ``{`` say, stays an answer.)

    Raises:
        ValueError: a tool result that answers no call (naming the message index).
    """
    fmt = fmt or toy_chat_format()
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant message's calls not answered yet
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        calls = list(message.get("tool_calls") or [])
        answered = i + 1 < len(messages) and messages[i + 1]["role"] == "tool"
        if role == "assistant" and not calls and content and answered:  # a model's calls written as text
            calls = _text_calls(content, fmt)
        if role == "assistant" and calls:
            ids = [str(c.get("id") or f"call_{i}" + (f"_{j}" if j else "")) for j, c in enumerate(calls)]
            wire = [{"id": call_id, "type": "function",
                     "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                    for call_id, c in zip(ids, calls)]  # fmt: skip
            pending = ids
            out.append({"role": "assistant", "content": content or None, "tool_calls": wire})
        elif role == "tool":
            call_id = message.get("tool_call_id") or (pending[0] if pending else None)
            if call_id is None or call_id not in pending:
                raise ValueError(
                    f"messages[{i}]: a tool result that answers no tool call of the assistant message before it "
                    "(a call that did not parse has no id an OpenAI-compatible API could match)"
                )
            pending.remove(call_id)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            pending = []
            out.append({"role": role, "content": content})
    return out


def chat_messages(messages: Sequence[Mapping[str, Any]], fmt: ChatFormat | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages (validated: every tool message answers a call by id) in the renderer's form,
    as the template of ``fmt`` (default: the toy's) renders them: an assistant message keeps all its
    calls, arguments decoded; one whose ``content`` holds calls written as text in ``fmt`` (what
    :func:`openai_messages` sends for a model's own text) is that text, its ``tool_calls`` only the ids."""
    fmt = fmt or toy_chat_format()
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls and not fmt.parse_turn(content).calls:
            flat = [{"name": c["function"]["name"], "arguments": call_arguments(c["function"]["arguments"])}
                    for c in calls]  # fmt: skip
            out.append({"role": "assistant", "content": content, "tool_calls": flat})
        else:
            out.append({"role": role, "content": content})
    return out


def call_turns(turn: TurnResult, fmt: ChatFormat) -> list[str]:
    """The generated turns (no end-of-turn token) one response stands for in the student's format
    ``fmt``: a local teacher's text is one turn; an API response with ``tool_calls`` is its assistant
    message rendered by the student's template (:meth:`~distillgates.data.chat.ChatFormat.assistant_text`),
    one turn per call in the toy format, one turn with all calls in Hermes and Llama 3. The eval loop
    answers the calls of each turn before the next."""
    return fmt.split_turns(turn.text) if turn.tool_calls else [turn.text]


def turn_messages(turn: TurnResult, results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages a response and the tool results of its calls add to the conversation: the
    API's assistant message as it came (``content``, calls with their ids) and one ``tool`` message
    per result, answering its call by id; a local teacher's turn stays text in its chat format (its
    calls are in ``content``)."""
    contents = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in results]
    if not turn.tool_calls:
        return [{"role": "assistant", "content": turn.text}, *({"role": "tool", "content": c} for c in contents)]
    calls = [dict(c) for c in turn.tool_calls]
    answers = [{"role": "tool", "tool_call_id": c["id"], "content": content} for c, content in zip(calls, contents)]
    return [{"role": "assistant", "content": turn.content, "tool_calls": calls}, *answers]
