"""The chat format: THE owner of how conversations become text and generated text becomes calls.

Every stage (data, teacher, training, eval, speed) renders through a :class:`ChatFormat` built from
the student's tokenizer: ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=...)``
with OpenAI-format messages (assistant ``tool_calls``, ``tool`` messages). The toy tokenizer's template
(:data:`distillgates.tokenizer.TOY_CHAT_TEMPLATE`) renders the toy format::

    <|bos|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>
    [preamble]<|tool_call|>{"name":...,"arguments":{...}}<|end|><|tool_result|>{result}<|end|><|assistant|>
    ... (a second call/result pair for multi items) ...
    {answer}<|end|><|eos|>

A :class:`ChatFormat` also owns the inverse direction, chosen per template family
(:data:`TOOL_CALL_FORMATS`: ``toy``, ``hermes`` ``<tool_call>{json}</tool_call>``, ``llama3`` JSON
with ``parameters``): parsing generated turns into calls, the text the runtime injects after a call
(the template's rendering of the tool messages, never a hand-written string), the stop ids and the
character spans of the generated (assistant) turns that training masks come from, and the text an
API teacher's structured assistant message (``content`` + ``tool_calls``) stands for in this format
(:meth:`ChatFormat.assistant_text`).

An item stores its target turns in ``reference`` as toy-format text (the serialization the data
files use whatever the student's template; :func:`reference_messages` reads it back as messages).
The system prompt lists the item's tools compactly (the whole toy registry for a toy item), so
every toy item of a locale shares the same prefix (what the prompt cache reuses).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from distillgates.config import sha256_json
from distillgates.data.registry import TOOLS
from distillgates.data.tools import canonical_call, item_tools, parse_tool_call
from distillgates.tokenizer import ASSISTANT, END, EOS, SPECIAL_TOKENS, TOOL_CALL, TOOL_RESULT

PROMPT_WRAPPER_VERSION = "1"

_SYSTEM_INTRO = {
    "en": "You are a helpful assistant. Never repeat personal data. Tools: ",
    "de": "Du bist ein hilfreicher Assistent. Gib keine persönlichen Daten wieder. Tools: ",
}
LOCALES = tuple(_SYSTEM_INTRO)
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


# --------------------------------------------------------------------------------------
# The toy serialization of an item's target turns (``item["reference"]``)


def tool_call_text(call: Mapping[str, Any], preamble: str = "") -> str:
    """One tool-call turn of a toy reference (after ``<|assistant|>``): ``preamble<|tool_call|>{json}<|end|>``."""
    return f"{preamble}{TOOL_CALL}{canonical_call(call)}{END}"


def tool_result_text(result: dict[str, Any]) -> str:
    """A tool result in a toy reference: ``<|tool_result|>{json}<|end|><|assistant|>``."""
    return f"{TOOL_RESULT}{_compact_json(result)}{END}{ASSISTANT}"


def answer_text(answer: str) -> str:
    """The final answer turn of a toy reference: ``answer<|end|><|eos|>``."""
    return f"{answer}{END}{EOS}"


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def reference_messages(reference: str) -> list[dict[str, Any]]:
    """The target turns of a toy reference as OpenAI messages (assistant ``tool_calls``, ``tool``, answer).

    Raises:
        ValueError: if the reference is not toy-format turns ending in an answer.
    """
    messages: list[dict[str, Any]] = []
    for turn in reference.split(ASSISTANT):
        if not turn:
            continue
        generated, _, result = turn.partition(TOOL_RESULT)
        if TOOL_CALL in generated:
            preamble, _, body = generated.partition(TOOL_CALL)
            call = parse_tool_call(body.removesuffix(END))
            if call is None:
                raise ValueError(f"reference turn {generated!r}: not a tool call")
            messages.append({"role": "assistant", "content": preamble, "tool_calls": [call]})
            messages.append({"role": "tool", "content": result.removesuffix(END)})
        else:
            messages.append({"role": "assistant", "content": generated.removesuffix(EOS).removesuffix(END)})
    if not messages or messages[-1].get("tool_calls") or messages[-1]["role"] != "assistant":
        raise ValueError(f"reference {reference[:80]!r}: expected toy turns ending in an answer")
    return messages


# --------------------------------------------------------------------------------------
# Tool-call parsers, one per template family


@dataclass
class ParsedTurn:
    """One generated assistant turn: its calls (``None`` for one that does not parse) and their raw
    text, or the answer when the turn makes no call. ``preamble``: the text before the first call,
    less the separator the family's templates write between a message's content and its calls (so
    it is the ``content`` of the OpenAI message the turn stands for)."""

    calls: list[dict[str, Any] | None]
    raw: list[str]
    answer: str | None
    preamble: str = ""


def _call_of(obj: Any, arguments_key: str) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` of a decoded call object with keys ``name`` and ``arguments_key``."""
    if not isinstance(obj, dict) or set(obj) != {"name", arguments_key}:
        return None
    if not isinstance(obj["name"], str) or not isinstance(obj[arguments_key], dict):
        return None
    return {"name": obj["name"], "arguments": obj[arguments_key]}


def _json_call(text: str, arguments_key: str) -> dict[str, Any] | None:
    try:
        return _call_of(json.loads(text), arguments_key)
    except (json.JSONDecodeError, RecursionError):
        return None


# What each family's parser keeps of the text before a turn's calls (its preamble): the template writes its own
# separator after it (ChatML: "\n<tool_call>"), so a server that returns it unstripped (vLLM) means the same turn
CALL_PREAMBLE: dict[str, Callable[[str], str]] = {"toy": str, "hermes": str.rstrip, "llama3": str.strip}


def parse_toy_turn(text: str) -> ParsedTurn:
    """Toy: ``[preamble]<|tool_call|>{"name":...,"arguments":{...}}``, else the answer. The toy template
    ends a turn after each call, so a turn holds one; a turn with several ``<|tool_call|>`` segments
    (what a server's parser reads as parallel calls) gives one call per segment."""
    if TOOL_CALL in text:
        preamble, *raws = text.split(TOOL_CALL)
        return ParsedTurn([parse_tool_call(raw) for raw in raws], raws, None, preamble)
    return ParsedTurn([], [], text)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes_turn(text: str) -> ParsedTurn:
    """Hermes / Qwen: any number of ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, else the answer."""
    if "<tool_call>" not in text:
        return ParsedTurn([], [], text)
    raws = [body.strip() for body in _HERMES_CALL.findall(text)]
    preamble = CALL_PREAMBLE["hermes"](text.split("<tool_call>", 1)[0])  # ChatML: content + "\n<tool_call>"
    return ParsedTurn([_json_call(raw, "arguments") for raw in raws], raws, None, preamble)


def parse_llama3_turn(text: str) -> ParsedTurn:
    """Llama 3: ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (several separated by ``;``), else the answer.

    A turn is a call when it opens with ``<|python_tag|>`` or ``{``.
    """
    tagged = "<|python_tag|>" in text
    preamble, _, body = text.partition("<|python_tag|>") if tagged else ("", "", text)
    body = body.strip()
    if not tagged and not body.startswith("{"):
        return ParsedTurn([], [], text)
    whole = _json_call(body, "parameters")
    if whole is not None:
        return ParsedTurn([whole], [body], None, CALL_PREAMBLE["llama3"](preamble))
    raws = [part.strip() for part in body.split(";") if part.strip()] or [body]
    return ParsedTurn([_json_call(raw, "parameters") for raw in raws], raws, None, CALL_PREAMBLE["llama3"](preamble))


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "toy": parse_toy_turn,
    "hermes": parse_hermes_turn,
    "llama3": parse_llama3_turn,
}
TOOL_CALL_FORMATS = tuple(TOOL_CALL_PARSERS)


def detect_tool_call_format(template: str) -> str:
    """The tool-call family a chat template writes: ``toy``, ``hermes`` or ``llama3``.

    Raises:
        ValueError: when the template shows none of them (set ``tokenizer.tool_call_format``).
    """
    if TOOL_CALL in template:
        return "toy"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eot_id|>" in template:
        return "llama3"
    raise ValueError("the chat template writes no known tool-call format (toy <|tool_call|>, hermes <tool_call>, "
                     "llama3 <|python_tag|>): choose a tool-capable template with tokenizer.chat_template (chatml, "
                     "or a .jinja file), or name its format with tokenizer.tool_call_format "
                     f"({', '.join(TOOL_CALL_FORMATS)})")  # fmt: skip


# --------------------------------------------------------------------------------------
# The chat format of a tokenizer

END_OF_TURN_TOKENS = (END, "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|endoftext|>")
"""Tokens that end an assistant turn in the template families known here (those in the vocabulary count)."""
Span = tuple[int, int]


def call_arguments(arguments: Any) -> Any:
    """A call's arguments as a template renders them: an OpenAI JSON string that decodes to an object is
    decoded (empty: ``{}``); any other string stays as it is, so a call whose arguments are not a JSON
    object (an API can return one) renders as written and parses back as a malformed call."""
    if not isinstance(arguments, str):
        return arguments
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


def _openai_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call in the OpenAI ``{"type", "function": {"name", "arguments": {...}}}`` form, arguments decoded."""
    function = call.get("function", call)
    arguments = call_arguments(function.get("arguments", {}))
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if "id" in call else out


def _openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}].role: expected one of assistant/system/tool/user, got {role!r}")
        if content is None and message.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        converted = {**message, "content": content}
        if message.get("tool_calls"):
            converted["tool_calls"] = [_openai_call(c) for c in message["tool_calls"]]
        out.append(converted)
    return out


def _openai_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [dict(t) if "function" in t else {"type": "function", "function": dict(t)} for t in tools]


@dataclass(frozen=True)
class CallSyntax:
    """How a chat format writes the calls of one generated turn: what constrained decoding enforces.

    A call turn reads ``[text] trigger open_rest JSON closer (separator trigger open_rest JSON closer)*``
    and then the end-of-turn token; JSON is ``{"name": ..., "<arguments_key>": {...}}`` exactly as
    ``json.dumps(..., ensure_ascii=False)`` writes it, with ``", "``/``": "`` separators when ``spaced``
    (the ``tojson`` filter of Hugging Face templates) else ``","``/``":"`` (the toy's). The template's own
    rendering of a call decides every field (:attr:`ChatFormat.call_syntax`); the family's parser reads
    that rendering (its JSON parser accepts either spacing).

    toy: ``<|tool_call|>`` + JSON, one call per turn; Hermes/ChatML: ``<tool_call>`` ``\\n`` JSON
    ``\\n</tool_call>``, calls separated by ``\\n``; Llama 3: a turn that is one bare JSON call with
    ``parameters`` (``opens_turn``), or ``<|python_tag|>`` + that JSON where the vocabulary has the tag.
    """

    trigger: str  # the text that opens a call (one special token or several ordinary ones)
    open_rest: str  # the text between the trigger and the JSON
    closer: str  # the text after the JSON
    separator: str | None  # the text between two calls of one turn; None: one call per turn
    arguments_key: str  # "arguments" (toy, Hermes) or "parameters" (Llama 3)
    spaced: bool  # JSON separators ", " and ": " (else "," and ":")
    opens_turn: bool = False  # a call may also be the whole turn, bare JSON from its first "{" (Llama 3)

    @property
    def reserved(self) -> tuple[str, ...]:
        """Texts a string argument never contains: ``<|`` (it would re-tokenize as a chat special token
        of these families) and the family's own tags (``</tool_call>`` would end the call for the parser)."""
        texts = ["<|", *(t for t in (self.trigger, self.closer.strip()) if t)]
        return tuple(t for t in dict.fromkeys(texts) if not any(o != t and o in t for o in texts))


_PROBE_CALL = {"name": "n", "arguments": {"a": 1, "b": [True, "x"]}}  # a call whose rendering shows the syntax


class ChatFormat:
    """The chat format of a tokenizer: rendering (its chat template), tool-call parsing, stop ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        tool_call_format: the parser family (:data:`TOOL_CALL_FORMATS`); ``None``: detected from the template.

    Raises:
        ValueError: without a chat template, for an unknown format, or a template that has no end-of-turn token.
    """

    def __init__(self, tokenizer: Any, tool_call_format: str | None = None) -> None:
        template = tokenizer.chat_template
        if not isinstance(template, str):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no (single) chat template")
        self.tokenizer = tokenizer
        self.tool_call_format = tool_call_format or detect_tool_call_format(template)
        if self.tool_call_format not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_format: expected one of {TOOL_CALL_FORMATS}, got {self.tool_call_format!r}")
        self._parse = TOOL_CALL_PARSERS[self.tool_call_format]
        vocab = tokenizer.get_vocab()
        ends = [t for t in END_OF_TURN_TOKENS if t in vocab]
        eos = tokenizer.eos_token
        self.stop_tokens: list[str] = ends + ([eos] if eos and eos not in ends else [])
        self.stop_ids: list[int] = [vocab[t] for t in self.stop_tokens]
        """Ids that end a generated turn: the end-of-turn tokens, then eos."""
        # Probe the template once: the header that opens an assistant turn, and what closes one.
        user = [{"role": "user", "content": "Q"}]
        opened = self.render(user, add_generation_prompt=True)
        self.assistant_header = opened[len(self.render(user)) :]
        closed = self.render([*user, {"role": "assistant", "content": "A"}])
        if not closed.startswith(opened + "A"):
            raise ValueError("the chat template does not render an answer right after its generation prompt")
        tail = closed[len(opened) + 1 :]
        self.end_of_turn = next((t for t in self.stop_tokens if tail.startswith(t)), "")
        if not self.end_of_turn:
            raise ValueError(f"the chat template closes an assistant turn with {tail[:20]!r}, not a stop token "
                             f"({self.stop_tokens})")  # fmt: skip
        self.answer_suffix = tail[len(self.end_of_turn) :]  # toy: <|eos|>; ChatML: "\n"
        self.end_of_turn_id: int = vocab[self.end_of_turn]
        self.assistant_header_ids: list[int] = self.encode(self.assistant_header)
        """Token ids that open an assistant turn (toy: ``<|assistant|>``); the last one predicts its first token."""
        self._check_tool_support(getattr(tokenizer, "name_or_path", "") or "")

    def _check_tool_support(self, name: str) -> None:
        """A conversation with a call and its result must survive the template: the call parses back out of its
        rendering and the result is in the text. A template that renders only ``content`` (SmolLM2's) would
        otherwise train every call turn as an empty turn.

        Raises:
            ValueError: naming the template's tokenizer, what it rendered and what the parser read.
        """
        where = f"the chat template of {name!r}" if name else "the chat template"
        turn = self.assistant_text("", [_PROBE_CALL])
        parsed = self.parse_turn(turn)
        if parsed.calls != [_PROBE_CALL]:
            raise ValueError(
                f"{where} does not write tool calls: the call {_compact_json(_PROBE_CALL)} renders as {turn!r} and "
                f"the {self.tool_call_format} parser reads back {parsed.calls or 'no call'}; choose a tool-capable "
                "template with tokenizer.chat_template (chatml, or a .jinja file)")  # fmt: skip
        result = {"probe_result": 7}
        if _compact_json(result) not in self.tool_results_text([result]).replace(" ", ""):
            raise ValueError(f"{where} drops tool results: a tool message's content is not in its rendering; choose "
                             "a tool-capable template with tokenizer.chat_template (chatml, or a .jinja file)")

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:  # fmt: skip
        """``apply_chat_template`` of OpenAI-format ``messages`` (and ``tools``) as text."""
        text = self.tokenizer.apply_chat_template(
            _openai_messages(messages), tools=_openai_tools(tools), add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )  # fmt: skip
        assert isinstance(text, str)
        return text

    def prompt(self, item: Mapping[str, Any]) -> str:
        """The prompt of ``item``: its messages and tools, up to the generation prompt."""
        return self.render(item["messages"], item_tools(item), add_generation_prompt=True)

    def conversation(self, item: Mapping[str, Any]) -> str:
        """The full reference conversation: the prompt followed by the reference's turns."""
        return self.render([*item["messages"], *reference_messages(item["reference"])], item_tools(item))

    def generated_spans(self, item: Mapping[str, Any]) -> list[Span]:
        """Character spans of :meth:`conversation` the model generates: each target assistant turn after
        its header up to and including its end-of-turn token (the final one also its eos, when the
        template ends a conversation with it). Found by rendering prefixes of the conversation.

        Raises:
            ValueError: when a rendered prefix is not a prefix of the conversation (the template
                rewrites earlier turns).
        """
        messages, tools = list(item["messages"]), item_tools(item)
        target = reference_messages(item["reference"])
        text = self.render([*messages, *target], tools)
        spans = []
        for k, message in enumerate(target):
            if message["role"] != "assistant":
                continue
            head = self.render([*messages, *target[:k]], tools, add_generation_prompt=True)
            if not text.startswith(head):
                raise ValueError(f"item {item.get('id')}: the chat template renders turn {k} as a different prefix")
            end = text.find(self.end_of_turn, len(head)) + len(self.end_of_turn)
            if k == len(target) - 1 and self.answer_suffix == self.tokenizer.eos_token:
                end += len(self.answer_suffix)
            spans.append((len(head), end))
        return spans

    def assistant_text(self, content: str | None, calls: Sequence[Mapping[str, Any]] = ()) -> str:
        """What a model in this format generates for the assistant message ``content`` + ``calls``
        (OpenAI or flat calls; arguments a JSON string or an object): the template's rendering of the
        message after the assistant header, up to (not including) its last end-of-turn token. A format
        that ends a turn after each call (the toy) gives several turns joined by its end-of-turn token
        (:meth:`split_turns`); Hermes and Llama 3 write all calls in one turn. With calls, ``content`` is taken as
        the family's parser returns a preamble (:data:`CALL_PREAMBLE`: Hermes without trailing whitespace), so
        a server's unstripped preamble renders the turn its model wrote.

        Raises:
            ValueError: when the template does not open the message with its generation prompt.
        """
        user = [{"role": "user", "content": "Q"}]
        head = self.render(user, add_generation_prompt=True)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            message["content"] = CALL_PREAMBLE[self.tool_call_format](message["content"])
            message["tool_calls"] = list(calls)
        text = self.render([*user, message])
        if not text.startswith(head) or self.end_of_turn not in text[len(head) :]:
            raise ValueError("the chat template does not render an assistant message as its generation prompt "
                             "followed by the turn and its end-of-turn token")  # fmt: skip
        turn = text[len(head) :]
        return turn[: turn.rindex(self.end_of_turn)]

    def split_turns(self, text: str) -> list[str]:
        """The generated turns of :meth:`assistant_text`'s text (one, or one per call for the toy)."""
        return text.split(self.end_of_turn)

    def call_text(self, call: Mapping[str, Any]) -> str:
        """A generated turn that makes just ``call``, up to (not including) its end-of-turn token."""
        return self.assistant_text("", [call])

    @cached_property
    def _probe_turn(self) -> tuple[str, int]:
        """The turn that makes :data:`_PROBE_CALL`, and where its JSON starts (-1: not as ``{"name"...``)."""
        one = self.assistant_text("", [_PROBE_CALL])
        return one, one.find('{"name"')

    @cached_property
    def call_marker_id(self) -> int | None:
        """The single token this template opens a call with (toy ``<|tool_call|>``, ChatML ``<tool_call>``), else
        None (Llama 3's bare JSON turn): the text before the call's JSON, as :attr:`call_syntax` finds it."""
        one, start = self._probe_turn
        marker = one[:start].strip() if start >= 0 else ""
        return self.tokenizer.get_vocab().get(marker) if marker else None

    @cached_property
    def call_syntax(self) -> CallSyntax:
        """The family's call syntax, read off the template's rendering of one and of two calls.

        Raises:
            ValueError: when the template writes a call that is not canonical ``json.dumps`` JSON, or
                opens it with no marker text outside the ``llama3`` family (whose parser reads a bare JSON turn).
        """
        call, (one, start) = _PROBE_CALL, self._probe_turn
        if start < 0:
            raise ValueError(f"the chat template writes a call as {one!r}: no JSON object that starts with 'name'")
        obj, end = json.JSONDecoder().raw_decode(one, start)
        body, prefix, closer = one[start:end], one[:start], one[end:]
        spaced = body == json.dumps(obj, ensure_ascii=False)
        if not spaced and body != _compact_json(obj):
            raise ValueError(f"the chat template writes a call as {body!r}: neither compact nor spaced json.dumps")
        trigger, key = prefix.strip(), next(k for k in obj if k != "name")
        if not trigger and self.tool_call_format == "llama3":
            # a bare JSON turn (what parse_llama3_turn reads when the turn opens with "{"), or <|python_tag|>{json}
            tag = "<|python_tag|>" if "<|python_tag|>" in self.tokenizer.get_vocab() else ""
            return CallSyntax(tag, "", closer, None, key, spaced, opens_turn=True)
        if not trigger:
            raise ValueError(f"the chat template opens a call with no marker ({one!r}) and its family "
                             f"({self.tool_call_format}) reads no bare JSON turn: constrained decoding cannot "
                             "tell where a call starts")  # fmt: skip
        two = self.assistant_text("", [call, call])
        between = two[len(one) : len(two) - len(one)]
        parallel = (two.startswith(one) and two.endswith(one) and len(two) >= 2 * len(one)
                    and not any(t in between for t in self.stop_tokens) and len(self.parse_turn(two).calls) == 2)
        at = prefix.index(trigger)
        return CallSyntax(trigger=trigger, open_rest=prefix[at + len(trigger) :], closer=closer,
                          separator=between + prefix[:at] if parallel else None, arguments_key=key,
                          spaced=spaced)  # fmt: skip

    def parse_turn(self, text: str) -> ParsedTurn:
        """Calls or answer of one generated turn (text after the assistant header; cut at its first stop token)."""
        return self._parse(self._cut(text))

    def parse_output(self, text: str) -> ParsedTurn:
        """Calls or answer of a whole generation (what a server's tool parser reads: nothing is cut)."""
        return self._parse(text)

    def _cut(self, text: str) -> str:
        at = min((i for i in (text.find(t) for t in self.stop_tokens) if i >= 0), default=len(text))
        return text[:at]

    def parse_transcript(self, text: str) -> tuple[list[dict[str, Any] | None], str | None]:
        """Split a generated transcript (what follows the prompt: turns and injected tool results).

        Returns:
            (calls in order, ``None`` for each that did not parse; the final answer or ``None``).
        """
        calls: list[dict[str, Any] | None] = []
        answer = None
        for chunk in text.split(self.assistant_header):
            turn = self._cut(chunk)
            if not turn:
                continue
            parsed = self._parse(turn)
            calls += parsed.calls
            if parsed.answer is not None:
                answer = parsed.answer
        return calls, answer

    def tool_results_text(self, results: Sequence[dict[str, Any]]) -> str:
        """What the runtime appends after a turn that made ``len(results)`` calls and ended on its
        end-of-turn token: the template's rendering of the ``tool`` messages and the next generation prompt."""
        calls = [{"name": "call", "arguments": {}} for _ in results]  # the families here do not echo the call
        before: list[dict[str, Any]] = [{"role": "user", "content": "Q"},
                                        {"role": "assistant", "content": "", "tool_calls": calls}]  # fmt: skip
        head = self.render(before)
        cut = head.rindex(self.end_of_turn) + len(self.end_of_turn)
        full = self.render([*before, *({"role": "tool", "content": _compact_json(r)} for r in results)],
                           add_generation_prompt=True)  # fmt: skip
        if not full.startswith(head[:cut]):
            raise ValueError("the chat template renders an assistant call differently once its results follow")
        return full[cut:]

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered ``text`` (no special tokens added: the template wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


_FORMATS: weakref.WeakKeyDictionary[Any, ChatFormat] = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any) -> ChatFormat:
    """The :class:`ChatFormat` of ``tokenizer`` (built once per tokenizer object). Its tool-call family is
    the tokenizer's own ``tool_call_format`` setting (saved in ``tokenizer_config.json`` by the data
    step when the config names one), else detected from the template."""
    if tokenizer not in _FORMATS:
        _FORMATS[tokenizer] = ChatFormat(tokenizer, tokenizer.init_kwargs.get("tool_call_format"))
    return _FORMATS[tokenizer]


@cache
def template_chat_format(chat_template: str = "toy") -> ChatFormat:
    """The format of a built-in template (:data:`distillgates.tokenizer.CHAT_TEMPLATES`) over a vocabulary of
    just its specials: rendering and parsing need no trained vocabulary."""
    from distillgates.tokenizer import template_tokenizer

    return chat_format(template_tokenizer(chat_template))


def toy_chat_format() -> ChatFormat:
    """The toy format (:func:`template_chat_format`)."""
    return template_chat_format("toy")


def render_messages(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Toy-format text of ``messages`` (:func:`toy_chat_format`), by default up to the generation prompt."""
    return toy_chat_format().render(messages, add_generation_prompt=add_generation_prompt)


def render_prompt(item: Mapping[str, Any]) -> str:
    """Toy-format prompt of ``item`` (:meth:`ChatFormat.prompt`)."""
    return toy_chat_format().prompt(item)


def render_conversation(item: Mapping[str, Any]) -> str:
    """Toy-format reference conversation of ``item`` (:meth:`ChatFormat.conversation`)."""
    return toy_chat_format().conversation(item)


def parse_assistant_turn(text: str) -> dict[str, Any] | str | None:
    """One toy turn: its call (``None`` if it does not parse) or its answer text."""
    parsed = toy_chat_format().parse_turn(text)
    return parsed.calls[0] if parsed.calls else parsed.answer


def parse_transcript(text: str) -> tuple[list[dict[str, Any] | None], str | None]:
    """Calls and answer of a toy transcript (:meth:`ChatFormat.parse_transcript`)."""
    return toy_chat_format().parse_transcript(text)


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
