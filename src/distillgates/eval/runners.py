"""Runners: drive a model through each eval item's multi-turn tool conversation.

One loop (:class:`Conversation`, driven by :func:`run_item`) serves every model kind, and the KD
builder too; a *session* only knows how to produce the next assistant turn:

- :class:`EngineSession`: the runtime engine (``distillgates.runtime``), token level; the tool
  result is appended to the KV state with ``continue_generate`` (no re-prefill).
- :func:`run_items_batched` (an :class:`EngineRunner` with ``batch_size`` > 1): many items decoded
  together on the engine's static-cache rows, in rounds of turns (below).
- :class:`HFSession`: any ``AutoModelForCausalLM`` directory, greedy ``generate`` over the
  conversation so far.
- :class:`TeacherSession`: anything with the teacher protocol's ``complete(messages, ...)``
  (the OpenAI-compatible HTTP teacher client with its determinism mode, or the local teacher).

The prompt is rebuilt from the item: the system prompt lists the item's own tools
(:func:`distillgates.data.chat.item_system_prompt`; the toy registry for a toy item) and the
conversation's earlier turns and last user message follow; nothing of the expected call reaches the
model. Each call is validated against the item's tools and answered by the :class:`ToolBroker` (a
call without a fixture by the :class:`FixturePolicy`); an unparsable call gets an error result (the
model may recover) and is never dispatched. Constrained decoding uses the item's tools; a schema it
cannot enforce (:class:`~distillgates.runtime.constrained.UnsupportedSchemaError`) makes that item
decode unconstrained, recorded in its output as ``unconstrained_reason`` (never silently).

Per-item output (what the scorer consumes; JSON-able)::

    {"id", "turns": [{"role": "assistant", "text", "tokens"} | {"role": "tool", "result"}],
     "calls": [{"raw", "call": dict|None, "errors": [str], "fixture_hit": bool|None[, "mocked": true]}],
     "answer": str|None, "tokens_out": int, "ttfa_tokens": int|None[, "unconstrained_reason": str]}

``ttfa_tokens`` counts generated tokens up to the end of the first valid call's JSON (its
closing ``<|end|>`` excluded); ``None`` when no valid call was made.

Batched eval (:func:`run_items_batched`): continuous batching over the engine's static-cache rows
(``TorchEngine.write_rows``). Each row holds one conversation at its own positions; every step
writes, for each row, what the batch-1 path would write next (the prompt; the last generated
token; after a turn, its pending stop token and the tool results) and reads the logits after it.
A row ends its turn on its own stop ids or its own budget (the batch-1 path's
``min(max_new_tokens, max_seq_len - tokens so far)``); the same :class:`Conversation` answers it,
and a finished item's row takes the next item at once. Greedy outputs equal the batch-1 path's up
to float rounding (a batched forward rounds differently from a one-row one, so a near-tie could
flip a token; none did on the toy eval set, docs/benchmarks.md section 8). Constrained decoding is
per item and token: the batched path refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from distillgates.data.chat import ChatFormat, chat_format, item_system_prompt, toy_chat_format
from distillgates.data.tools import item_tools, validate_call
from distillgates.eval.broker import FixturePolicy, ToolBroker
from distillgates.eval.fingerprints import directory_fingerprint, runner_fingerprint
from distillgates.teacher.messages import call_turns, turn_messages


@dataclass
class Turn:
    text: str  # generated text of the turn, stop token excluded
    tokens: int  # generated tokens, stop token included
    stopped: bool  # ended on a stop token (not the budget)
    ids: tuple[int, ...] = ()  # the generated token ids, stop included (token sessions; an API's turn has none)


class Session(Protocol):
    """Produces assistant turns of one conversation in a chat format."""

    chat_format: ChatFormat

    def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn: ...

    def next_turn(self, results: list[dict[str, Any]]) -> Turn: ...


class Runner(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def decoding(self) -> dict[str, Any]: ...

    @property
    def model_fingerprint(self) -> str: ...

    def session(self) -> Session: ...


def eval_prompt_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """The item as the model sees it: the system prompt of its tools + its other messages, and its tools."""
    turns = [dict(m) for m in item["messages"] if m["role"] != "system"]
    if not any(m["role"] == "user" for m in turns):
        raise ValueError(f"item {item.get('id')}: no user message")
    system = {"role": "system", "content": item_system_prompt(item)}
    return {"id": item["id"], "messages": [system, *turns], "tools": item_tools(item)}


class Conversation:
    """One item's tool conversation, fed one generated turn at a time.

    The one place that decides what follows a generated turn: an answer ends the conversation; a
    call is parsed, validated and answered by the item's :class:`ToolBroker` (an unparsable call
    gets an error result and is never dispatched); the conversation ends after ``max_calls`` calls
    or a turn the token budget cut short. :func:`run_item` drives it with one session; the KD
    builder (:mod:`distillgates.teacher.kd`) drives a batch of them with one teacher request per
    turn. ``fmt`` is the chat format of the tokenizer that generated the turns (TTFA decodes a turn's ids).
    """

    def __init__(self, item: Mapping[str, Any], max_calls: int = 4, policy: FixturePolicy | None = None,
                 fmt: ChatFormat | None = None) -> None:  # fmt: skip
        self.fmt = fmt or toy_chat_format()
        self.id = str(item["id"])
        self.tools = item_tools(item)
        self.broker = ToolBroker.for_item(item, policy)
        self.max_calls = max_calls
        self.turns: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.tokens_out = 0
        self.ttfa: int | None = None
        self.answer: str | None = None

    def add_turn(self, turn: Turn) -> list[dict[str, Any]] | None:
        """Record a generated turn; returns the tool results the model gets next (one per call of the
        turn), None when the conversation is over."""
        self.tokens_out += turn.tokens
        self.turns.append({"role": "assistant", "text": turn.text, "tokens": turn.tokens})
        parsed = self.fmt.parse_turn(turn.text)
        if parsed.answer is not None:
            self.answer = parsed.answer
            return None
        results: list[dict[str, Any]] = []
        for call, raw in zip(parsed.calls, parsed.raw, strict=True):
            errors = ["malformed_call: $: not a JSON tool call"] if call is None else validate_call(call, self.tools)
            if call is None:
                result, hit, mocked = {"error": "invalid tool call JSON"}, None, False
            else:
                result, hit, mocked = self.broker.call(call["name"], call["arguments"])
            if self.ttfa is None and call is not None and not errors:
                self.ttfa = self.tokens_out - turn.tokens + self._tokens_to_call(turn, len(results), call)
            record = {"raw": raw, "call": call, "errors": errors, "fixture_hit": hit}
            self.calls.append({**record, "mocked": True} if mocked else record)
            self.turns.append({"role": "tool", "result": result})
            results.append(result)
        if len(self.calls) >= self.max_calls or not turn.stopped:
            return None
        return results

    def _tokens_to_call(self, turn: Turn, index: int, call: dict[str, Any]) -> int:
        """Tokens of ``turn`` up to the end of its call number ``index`` (``call``): the fewest whose text parses
        to that call there (a scan from the first token: not a binary search, a complete call does not stay
        complete in every longer prefix, e.g. not while its closing tag is half generated); the stop token is
        never counted. A turn without token ids (an API teacher's) counts whole."""
        body = turn.ids[:-1] if turn.stopped else turn.ids
        if not body:
            return max(0, turn.tokens - int(turn.stopped))

        def holds(k: int) -> bool:
            text = self.fmt.tokenizer.decode(body[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            calls = self.fmt.parse_turn(text).calls
            return len(calls) > index and calls[index] == call

        return next((k for k in range(1, len(body)) if holds(k)), len(body))  # holds(len(body)): the turn's own text

    def output(self) -> dict[str, Any]:
        """The per-item output the scorer consumes (module docstring)."""
        return {
            "id": self.id,
            "turns": self.turns,
            "calls": self.calls,
            "answer": self.answer,
            "tokens_out": self.tokens_out,
            "ttfa_tokens": self.ttfa,
        }


def run_item(
    item: Mapping[str, Any], session: Session, max_calls: int = 4, policy: FixturePolicy | None = None
) -> dict[str, Any]:
    """Run one item: turns until an answer, at most ``max_calls`` tool calls."""
    prompt_item = eval_prompt_item(item)
    conversation = Conversation(item, max_calls, policy, session.chat_format)
    results = conversation.add_turn(session.first_turn(prompt_item, session.chat_format.prompt(prompt_item)))
    while results is not None:
        results = conversation.add_turn(session.next_turn(results))
    output = conversation.output()
    if reason := getattr(session, "unconstrained_reason", None):
        output["unconstrained_reason"] = reason
    return output


def run_items(
    runner: Runner, items: Iterable[Mapping[str, Any]], max_calls: int = 4, progress: bool = False,
    policy: FixturePolicy | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per-item outputs, in order: one item at a time, or batched (an :class:`EngineRunner` with ``batch_size`` > 1)."""
    from distillgates.progress import ProgressBar

    items = list(items)
    with ProgressBar(f"eval ({runner.kind})", len(items), enabled=progress) as bar:
        if isinstance(runner, EngineRunner) and runner.batch_size > 1:
            return run_items_batched(runner, items, max_calls, policy, on_item_done=lambda: bar.update(1))
        outputs = []
        for item in items:
            outputs.append(run_item(item, runner.session(), max_calls=max_calls, policy=policy))
            bar.update(1)
    return outputs


@dataclass
class _Row:
    """One open conversation of the batched path, in one cache row of the engine."""

    index: int  # of its item
    conversation: Conversation
    written: int  # tokens in the row's KV state
    chunk: list[int]  # tokens to write next: the prompt, the pending stop token + tool results, or the last token
    budget: int  # new tokens the current turn may still reach (EngineSession._budget at the turn's start)
    turn: list[int]  # the current turn's tokens so far
    ids: list[int]  # the conversation's tokens: the prompt, its turns (stop tokens included), the tool results
    prompt_len: int
    turns: int = 0  # turns started (the current one's number, from 1)
    generated: list[tuple[int, int]] = field(default_factory=list)  # (first prediction position, tokens) a turn


@dataclass
class Played:
    """One item's conversation on the batched path: what the scorer reads, and the tokens the model saw."""

    output: dict[str, Any]  # the per-item output (module docstring)
    ids: list[int]  # the prompt, each turn with its stop token, the tool results between turns
    prompt_len: int
    generated: list[tuple[int, int]]  # each generated turn: (position whose logits predict its first token, tokens)


PickToken = Callable[[int, int, torch.Tensor], int]
"""``(item index, turn number from 1, (V,) logits) -> token``: how the batched path picks each generated token."""


def _greedy(index: int, turn: int, logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))  # as sample_token at temperature 0


def run_items_batched(
    runner: EngineRunner, items: Sequence[Mapping[str, Any]], max_calls: int = 4,
    policy: FixturePolicy | None = None, on_item_done: Callable[[], object] = lambda: None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per-item outputs of ``items``, up to ``runner.batch_size`` decoded together, greedy (module docstring).

    Raises:
        ValueError: constrained decoding is on, or the engine has fewer rows than ``batch_size``.
    """
    if runner.constrained:
        raise ValueError("eval.batch_size > 1 cannot decode with constrained tool calls (a constraint per "
                         "item and token): set eval.batch_size: 1 or eval.constrained_tool_calls: false")  # fmt: skip
    played = play_batched(runner.engine, runner.tokenizer, items, runner.batch_size, runner.max_new_tokens,
                          max_calls, policy, on_item_done)  # fmt: skip
    return [p.output for p in played]


def play_batched(
    engine: Any, tokenizer: Any, items: Sequence[Mapping[str, Any]], batch_size: int, max_new_tokens: int,
    max_calls: int = 4, policy: FixturePolicy | None = None, on_item_done: Callable[[], object] = lambda: None,
    pick: PickToken = _greedy,
) -> list[Played]:  # fmt: skip
    """Each item's conversation, up to ``batch_size`` decoded together on the engine's cache rows (module
    docstring), every token chosen by ``pick`` (greedy by default; on-policy training samples,
    :mod:`distillgates.train.on_policy`).

    Raises:
        ValueError: the engine has fewer rows than ``batch_size``.
    """
    if getattr(engine, "max_batch_size", 1) < batch_size or not hasattr(engine, "write_rows"):
        have = getattr(engine, "max_batch_size", 1)
        raise ValueError(f"eval.batch_size {batch_size} needs an engine with write_rows and at least that many "
                         f"cache rows, got a {type(engine).__name__} with {have}")  # fmt: skip
    session = _TokenSession(tokenizer, max_new_tokens)  # encoding, stop ids, turns
    fmt, max_seq_len, stops = session.chat_format, int(engine.max_seq_len), frozenset(session.stop_ids)
    played: list[Played | None] = [None] * len(items)
    waiting = list(enumerate(items))[::-1]  # popped from the end: in order
    rows: list[_Row | None] = [None] * batch_size

    def start_turn(row: _Row, chunk: list[int]) -> bool:
        """Set the row's next turn; False when the context is full (an empty turn ended the item, as at batch 1)."""
        row.chunk, row.turn, row.turns = chunk, [], row.turns + 1
        row.budget = max(0, min(max_new_tokens, max_seq_len - row.written - len(chunk)))
        return row.budget > 0 or end_turn(row)

    def end_turn(row: _Row) -> bool:
        """Record the turn; True when the conversation goes on (its next turn is set)."""
        if row.turn:
            row.generated.append((len(row.ids) - len(row.turn) - 1, len(row.turn)))
        results = row.conversation.add_turn(session.turn(row.turn))
        if results is None:
            played[row.index] = Played(row.conversation.output(), row.ids, row.prompt_len, row.generated)
            on_item_done()
            return False
        # the batch-1 path's extend: the pending last token, then the tool results
        results_ids = session.encode(fmt.tool_results_text(results))
        row.ids += results_ids
        return start_turn(row, row.turn[-1:] + results_ids)

    while True:
        for slot in range(batch_size):
            while rows[slot] is None and waiting:
                index, item = waiting.pop()
                prompt = session.encode(fmt.prompt(eval_prompt_item(item)))
                row = _Row(index, Conversation(item, max_calls, policy, fmt), 0, [], 0, [], list(prompt), len(prompt))
                rows[slot] = row if start_turn(row, prompt) else None
        open_rows = {slot: row for slot, row in enumerate(rows) if row is not None}
        if not open_rows:
            assert all(p is not None for p in played)  # every item ends (its turns are bounded)
            return played  # type: ignore[return-value]
        # prompts and tool results first, apart: padding a one-token step to their length would waste the step
        slots = [slot for slot, row in open_rows.items() if len(row.chunk) > 1] or list(open_rows)
        batch = [open_rows[slot] for slot in slots]
        logits = engine.write_rows(slots, [row.chunk for row in batch], [row.written for row in batch])  # (B, V)
        for slot, row, row_logits in zip(slots, batch, logits, strict=True):
            row.written += len(row.chunk)
            token = pick(row.index, row.turns, row_logits)
            row.turn.append(token)
            row.ids.append(token)
            row.chunk = [token]
            if (token in stops or len(row.turn) == row.budget) and not end_turn(row):
                rows[slot] = None


def runner_fingerprint_of(runner: Runner) -> str:
    return runner_fingerprint(runner.kind, runner.decoding)


# --------------------------------------------------------------------------------------
# Token-level sessions


class _TokenSession:
    def __init__(self, tokenizer: Any, max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.chat_format = chat_format(tokenizer)
        self.max_new_tokens = max_new_tokens
        self.stop_ids = self.chat_format.stop_ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn(self, ids: Sequence[int]) -> Turn:
        ids = list(ids)
        stopped = bool(ids) and ids[-1] in self.stop_ids
        body = ids[:-1] if stopped else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return Turn(text=text, tokens=len(ids), stopped=stopped, ids=tuple(ids))


class EngineSession(_TokenSession):
    """A conversation on a runtime engine; tool results extend the KV state."""

    def __init__(self, engine: Any, tokenizer: Any, max_new_tokens: int, constrained: bool = False) -> None:
        super().__init__(tokenizer, max_new_tokens)
        self.engine = engine
        self.constrained = constrained
        self.tools: list[dict[str, Any]] | None = None  # the item's (set by first_turn)
        self.unconstrained_reason: str | None = None  # the item's tools cannot be enforced: decoded freely

    def _decode(self) -> dict[str, Any]:
        """Generation arguments of one turn: stop tokens, and a fresh constraint to the item's tools when enabled."""
        if not self.constrained or self.unconstrained_reason is not None:
            return {"stop_ids": self.stop_ids}
        from distillgates.runtime.constrained import UnsupportedSchemaError, tool_call_processor

        try:
            processor = tool_call_processor(self.tokenizer, self.tools)
        except UnsupportedSchemaError as err:  # explicit fallback, recorded in the item's output
            self.unconstrained_reason = str(err)
            return {"stop_ids": self.stop_ids}
        return {"stop_ids": self.stop_ids, "logits_processor": processor}

    def _budget(self, used: int) -> int:
        """New tokens that still fit the engine's context (``used`` tokens already in it)."""
        room = getattr(self.engine, "max_seq_len", used + self.max_new_tokens) - used
        return max(0, min(self.max_new_tokens, room))

    def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn:
        self.tools = item.get("tools")
        prompt = self.encode(prompt_text)
        budget = self._budget(len(prompt))
        if budget == 0:  # the prompt alone fills the context: an empty (failed) answer, not a crash
            return Turn(text="", tokens=0, stopped=False)
        return self.turn(list(self.engine.generate(prompt, max_new_tokens=budget, **self._decode())))

    def next_turn(self, results: list[dict[str, Any]]) -> Turn:
        ids = self.encode(self.chat_format.tool_results_text(results))
        budget = self._budget(self.engine.position + 1 + len(ids))  # + the pending stop token
        if budget == 0:
            return Turn(text="", tokens=0, stopped=False)
        return self.turn(list(self.engine.continue_generate(ids, max_new_tokens=budget, **self._decode())))


@dataclass
class EngineRunner:
    """Greedy local runner over a runtime engine (``TorchEngine`` or the Core ML engine).

    ``constrained``: tool calls decode under the runtime's constrained JSON decoding
    (:func:`distillgates.runtime.constrained.tool_call_processor`); part of the runner fingerprint.
    ``batch_size``: items decoded together (:func:`run_items_batched`; the engine needs that many
    cache rows); above 1 it is part of the runner fingerprint.
    """

    engine: Any
    tokenizer: Any
    model_fingerprint: str
    max_new_tokens: int = 96
    constrained: bool = False
    kind: str = "local_engine"
    batch_size: int = 1

    @property
    def decoding(self) -> dict[str, Any]:
        batched = {"batch_size": self.batch_size} if self.batch_size > 1 else {}  # batch 1: fingerprints as before
        return {"greedy": True, "max_new_tokens": self.max_new_tokens, "engine": type(self.engine).__name__,
                "constrained_tool_calls": self.constrained, **batched}  # fmt: skip

    def session(self) -> Session:
        return EngineSession(self.engine, self.tokenizer, self.max_new_tokens, self.constrained)


class HFSession(_TokenSession):
    """A conversation on a Hugging Face causal LM (greedy; re-encodes the whole history each turn)."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int) -> None:
        super().__init__(tokenizer, max_new_tokens)
        self.model = model
        self.ids: list[int] = []

    def _generate(self) -> Turn:
        input_ids = torch.tensor([self.ids])  # (1, T)
        with torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                eos_token_id=self.stop_ids,
                pad_token_id=self.tokenizer.pad_token_id,
            )  # (1, T + new)
        new = out[0, input_ids.shape[1] :].tolist()
        self.ids += new
        return self.turn(new)

    def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn:
        self.ids = self.encode(prompt_text)
        return self._generate()

    def next_turn(self, results: list[dict[str, Any]]) -> Turn:
        self.ids += self.encode(self.chat_format.tool_results_text(results))
        return self._generate()


@dataclass
class HFRunner:
    """Greedy runner for any ``AutoModelForCausalLM`` directory (local files only)."""

    model: Any
    tokenizer: Any
    model_fingerprint: str
    max_new_tokens: int = 96
    kind: str = "hf_local"

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: Any, max_new_tokens: int = 96) -> HFRunner:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
        return cls(model, tokenizer, directory_fingerprint(path), max_new_tokens)

    @property
    def decoding(self) -> dict[str, Any]:
        return {"greedy": True, "max_new_tokens": self.max_new_tokens}

    def session(self) -> Session:
        return HFSession(self.model, self.tokenizer, self.max_new_tokens)


# --------------------------------------------------------------------------------------
# Message-level session (teacher protocol: local teacher or OpenAI-compatible HTTP client)


class TeacherSession:
    """A conversation through ``teacher.complete(messages, tools=...)``: the item's tools go with every
    request; a response with several (parallel) tool calls is played as the teacher tokenizer's chat
    format writes them (toy: one call per turn) and the next request answers them all
    (:mod:`distillgates.teacher.messages`)."""

    def __init__(self, teacher: Any, max_new_tokens: int, temperature: float) -> None:
        self.teacher = teacher
        tokenizer = getattr(teacher, "tokenizer", None)  # the teacher's text is in its tokenizer's format
        self.chat_format = chat_format(tokenizer) if tokenizer is not None else toy_chat_format()
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.response: Any = None  # the last TurnResult
        self.queued: list[str] = []  # its further parallel calls, not played yet
        self.results: list[dict[str, Any]] = []  # the tool results of its calls so far

    def _complete(self) -> Turn:
        result = self.teacher.complete(
            self.messages, max_new_tokens=self.max_new_tokens, top_k=1, temperature=self.temperature, tools=self.tools
        )
        self.response, self.results = result, []
        first, *self.queued = call_turns(result, self.chat_format)
        return Turn(text=first, tokens=int(result.completion_tokens), stopped=result.finish_reason == "stop")

    def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn:
        self.messages = [dict(m) for m in item["messages"]]
        self.tools = item_tools(item)
        return self._complete()

    def next_turn(self, results: list[dict[str, Any]]) -> Turn:
        self.results += results
        if self.queued:  # the next parallel call of the same response
            return Turn(text=self.queued.pop(0), tokens=0, stopped=True)
        self.messages += turn_messages(self.response, self.results)
        return self._complete()


@dataclass
class TeacherRunner:
    """Runner over the teacher protocol: evaluates a served (OpenAI-compatible) or local teacher.

    Determinism (temperature 0, no retries, any retry an error) is the teacher client's mode
    (``TeacherConfig.determinism``); this runner always asks for temperature 0 by default.
    """

    teacher: Any
    max_new_tokens: int = 96
    temperature: float = 0.0
    kind: str = "teacher"

    @property
    def model_fingerprint(self) -> str:
        return str(self.teacher.model_id)

    @property
    def decoding(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "client": type(self.teacher).__name__,
            "determinism": bool(getattr(getattr(self.teacher, "cfg", None), "determinism", False)),
        }

    def session(self) -> Session:
        return TeacherSession(self.teacher, self.max_new_tokens, self.temperature)


def reference_output(item: Mapping[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """The output a perfect model would produce: the item's reference replayed through the broker.

    Used to check the scorer (a reference scores 1.0) and as the oracle in tests. Turns are the
    generated spans of the reference conversation in ``tokenizer``'s chat format (the toy format
    without one); token counts need ``tokenizer`` (0 without it).
    """
    fmt = chat_format(tokenizer) if tokenizer is not None else toy_chat_format()
    text = fmt.conversation(item)
    spans = fmt.generated_spans(item)
    turns = iter(spans)

    class _Replay:
        chat_format = fmt

        def _turn(self) -> Turn:
            start, end = next(turns)
            generated = text[start:end]
            stop = min((t for t in fmt.stop_tokens if t in generated), key=generated.index, default=None)
            body = generated[: generated.index(stop)] if stop else generated
            ids = tuple(fmt.encode(body + (stop or ""))) if tokenizer is not None else ()
            return Turn(text=body, tokens=len(ids), stopped=stop is not None, ids=ids)

        def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn:
            return self._turn()

        def next_turn(self, results: list[dict[str, Any]]) -> Turn:
            return self._turn()

    return run_item(item, _Replay(), max_calls=len(spans))
