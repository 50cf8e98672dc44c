"""Conversations as the OpenAI chat-completions API takes them, and back.

The project keeps a conversation in the renderer's form (:func:`distillgates.data.chat.render_messages`):
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
from the item's history, or one a local model wrote as ``<|tool_call|>{json}`` text, gets
``call_<message index>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from distillgates.data.tools import canonical_call, parse_tool_call
from distillgates.teacher.base import TurnResult
from distillgates.tokenizer import END, TOOL_CALL


def call_text(name: str, arguments: str) -> str:
    """An API's structured call as the chat format's call JSON (what follows ``<|tool_call|>``).

    Arguments that parse as a JSON object give the canonical call; anything else (an API can return
    arguments that are not JSON) keeps the raw string, which the eval loop then reports as an
    unparsable call.
    """
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return canonical_call({"name": name, "arguments": parsed})
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The renderer's messages as OpenAI chat messages (module docstring).

    A ``tool`` message without ``tool_call_id`` answers the oldest call of the assistant message
    before it that is not answered yet (the data reader's and the eval loop's order). A call written
    as ``<|tool_call|>`` text that does not parse (a project-format model) becomes a call with an
    empty name and the raw text as its arguments, so its error result still answers an id.

    Raises:
        ValueError: a tool result that answers no call (naming the message index).
    """
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant message's calls not answered yet
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        calls = list(message.get("tool_calls") or [])
        if role == "assistant" and not calls and TOOL_CALL in content:  # a local model's call, written as text
            content, body = content.split(TOOL_CALL, 1)
            body = body.split(END, 1)[0]
            calls = [parse_tool_call(body) or {"name": "", "arguments": body}]  # unparsable: no name, raw text
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


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages (validated: every tool message answers a call by id) in the renderer's
    form, parallel calls interleaved with their results as the data reader writes them."""
    out: list[dict[str, Any]] = []
    calls: dict[str, Mapping[str, Any]] = {}
    content = ""
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = {c["id"]: c["function"] for c in message["tool_calls"]}
            content = message.get("content") or ""
        elif role == "tool":
            function = calls[message["tool_call_id"]]
            parsed = parse_tool_call(call_text(function["name"], function["arguments"]))
            if not function["name"]:  # an unparsable call (openai_messages): the text the model wrote
                out.append({"role": "assistant", "content": content + TOOL_CALL + function["arguments"]})
            else:
                call = {"name": function["name"], "arguments": parsed["arguments"] if parsed else function["arguments"]}
                out.append({"role": "assistant", "content": content, "tool_calls": [call]})
            out.append({"role": "tool", "content": message.get("content") or ""})
            content = ""  # the preamble belongs to the first call only
        else:
            out.append({"role": role, "content": message.get("content") or ""})
    return out


def call_turns(turn: TurnResult) -> list[str]:
    """The assistant turns (chat format, no ``<|end|>``) one response stands for: its text, then one
    ``<|tool_call|>{json}`` turn per further parallel call; the eval loop answers each in order."""
    return [turn.text] + [TOOL_CALL + call_text(c["name"], c["arguments"]) for c in turn.tool_calls[1:]]


def turn_messages(turn: TurnResult, results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages a response and the tool results of its calls add to the conversation: the
    API's assistant message with its calls (ids kept) and one ``tool`` message per result, answering
    its call by id; a local teacher's turn stays chat-format text (its call is in ``content``)."""
    contents = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in results]
    if not turn.tool_calls:
        return [{"role": "assistant", "content": turn.text}, *({"role": "tool", "content": c} for c in contents)]
    preamble = turn.text.split(TOOL_CALL, 1)[0]
    calls = [dict(c) for c in turn.tool_calls]
    answers = [{"role": "tool", "tool_call_id": c["id"], "content": content} for c, content in zip(calls, contents)]
    return [{"role": "assistant", "content": preamble, "tool_calls": calls}, *answers]
