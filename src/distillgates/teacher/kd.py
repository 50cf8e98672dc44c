"""KD-set builder: ask a teacher (local or HTTP) to complete every prompt, write a KD JSONL.

Per item the teacher plays the whole assistant side through the eval loop
(:class:`distillgates.eval.runners.Conversation`: the same call parsing, fixture matching by the
:class:`~distillgates.eval.broker.ToolBroker` and stop conditions as evaluation). It generates a
turn up to the student format's end-of-turn token (toy ``<|end|>``, ChatML ``<|im_end|>``); a tool
call gets its result injected as the student's template renders it (toy
``<|tool_result|>..<|end|><|assistant|>``, exactly as the runtime does) and the teacher goes on,
until it answers (then what the template writes after an answer: toy ``<|eos|>``), runs out of
tokens, or has made ``teacher.max_turns`` calls. The conversations of a chunk advance together: one
batched teacher request per turn. An API teacher gets the item's tools with every request and its
structured ``tool_calls`` back, rendered in the student's chat format by the student's template
(:mod:`.http`): the record's text is what the student's template makes of the teacher's messages,
whatever format the teacher writes. Parallel calls of one response are played as that format writes
them (toy: one call per turn, each answered before the next, the data reader's layout; Hermes /
Llama 3: all calls in one turn, the results together) and the next request answers them by
``tool_call_id`` (:mod:`.messages`).

Record (one JSON line per item, after a header line)::

    id, prompt_text, completion_text, completion_ids, topk_ids, topk_logprobs, request_id,
    request_ids, calls, answer, fixture_hits, finish

- ``completion_ids`` are the teacher's own ids for generated tokens (so they align with its
  top-k) and the tokenizer's ids for injected text; ``decode(completion_ids) == completion_text``
  is checked for every record. They can differ from ``encode(completion_text)`` where the
  teacher chose a non-canonical BPE segmentation.
- ``topk_ids[i]``/``topk_logprobs[i]`` is the teacher's next-token top-k that *predicted*
  ``completion_ids[i]``; it is ``[]`` where the teacher gave none: injected tool results,
  ``<|eos|>``, the ``<|end|>`` of an API teacher (stop sequences are not reported), and every
  token of an API turn whose token bytes do not spell its text (text-only KD; see
  :mod:`distillgates.teacher.http`). Log-probs are rounded to 5 decimals. A teacher with another
  tokenizer (API, or local: :class:`~distillgates.teacher.local.StudentTokensTeacher`) gives our
  tokens of its text in our chat format and its top-k moved onto them through bytes
  (:func:`distillgates.teacher.tokens.map_by_bytes`): rows of distinct ids, at most ``top_k + 1``
  long, whose mass may sum to less than the teacher's (unmatched mass: the loss's rest bucket).
  A set built with ``teacher.api.logprobs: false`` has ``"logprobs": false`` in its header and no
  top-k at all: training then uses sequence-level KD on ``completion_text``
  (:mod:`distillgates.train.data`).
- ``calls`` (parsed, ``None`` where unparsable), ``answer``, ``fixture_hits`` (per call; ``None``
  for an unparsable one) come from the eval loop; ``finish`` is ``stop`` (answered), ``length``
  (a turn hit ``max_new_tokens``) or ``max_turns``.

Coverage: the share of the student positions of teacher-written turns (injected text excluded)
that carry a teacher distribution, ``KDBuildResult.coverage`` (also in the pipeline's
``kd/build.json`` and the report's ``gate_inputs.teacher``). 1.0 for a teacher with our
tokenizer; an API teacher with another one got ~0 before the byte mapping (one foreign token made
the turn text-only), and a local one wrote the set on its own tokens (training now refuses such a
set: :func:`distillgates.train.data.read_kd_set`).

Robustness: a SHA-256 keyed response cache (:mod:`.cache`; the key also holds the student's
tokenizer fingerprint, since a cached turn is on its tokens and in its chat format), records appended to
``<out>.partial`` and a checkpoint ``<out>.ckpt`` (atomic JSON with an embedded sha256 of its
state and of the ``.partial`` prefix it vouches for) every ``ckpt_every`` items. ``resume``
truncates ``.partial`` to the checkpointed prefix and continues with the next item: no
duplicates, no gaps, and byte-identical output to an uninterrupted run (items are processed in
the same fixed chunks of ``kd.batch_size``). Budget (tokens, USD) is checked after each chunk;
at the limit the builder checkpoints and stops with a message saying how to continue.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from distillgates.config import Config, KDConfig, TeacherConfig, sha256_json
from distillgates.data.chat import chat_format, prompt_wrapper_sha256
from distillgates.data.registry import tool_registry_sha256
from distillgates.data.tools import item_tools
from distillgates.eval.runners import Conversation, Turn
from distillgates.io import atomic_write_json, sha256_bytes
from distillgates.teacher.base import BatchTeacher, Teacher, TurnResult
from distillgates.teacher.cache import ResponseCache, cache_key
from distillgates.teacher.messages import call_turns, turn_messages
from distillgates.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

KD_VERSION = 1
CKPT_VERSION = 2  # 2: coverage counts in the state
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "prompt_text": str,
    "completion_text": str,
    "completion_ids": list,
    "topk_ids": list,
    "topk_logprobs": list,
    "request_id": str,
    "request_ids": list,
    "calls": list,
    "answer": (str, type(None)),
    "fixture_hits": list,
    "finish": str,
}
HEADER_FIELDS = ("kd_version", "teacher_model_id", "tokenizer_fingerprint", "tool_registry_sha256",
                 "prompt_wrapper_sha256", "items_sha256", "top_k", "total")  # fmt: skip


class KDSetError(ValueError):
    """A KD set file is malformed (message names file, line and field)."""


class KDCheckpointError(ValueError):
    """A KD checkpoint is corrupted or does not belong to this build."""


@dataclass
class KDBuildResult:
    status: str  # "complete" or "budget_exhausted"
    path: Path  # the final KD set (complete) or the .partial file (stopped)
    n_done: int
    total: int
    spent_tokens: int
    spent_usd: float
    cache_hits: int = 0
    retries: int = 0
    message: str = ""
    positions: int = 0  # student positions of teacher-written turn text
    covered: int = 0  # of those, the ones carrying a teacher distribution

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def coverage(self) -> float:
        """Share of the student positions of teacher-written text that carry a teacher distribution."""
        return self.covered / self.positions if self.positions else 0.0


# --------------------------------------------------------------------------------------
# One conversation


class KDConversation:
    """One training conversation's tokens: the teacher's ids and top-k for generated text, the
    tokenizer's for injected text. What follows each turn is the eval loop's decision
    (:class:`~distillgates.eval.runners.Conversation`)."""

    def __init__(self, item: dict[str, Any], tokenizer: Any, max_turns: int) -> None:
        self.item, self.tokenizer = item, tokenizer
        self.fmt = chat_format(tokenizer)
        self.loop = Conversation(item, max_calls=max_turns, fmt=self.fmt)
        self.messages = [dict(m) for m in item["messages"]]
        self.tools = item_tools(item)  # sent to an API teacher with every request
        self.text = ""
        self.ids: list[int] = []
        self.topk_ids: list[list[int]] = []
        self.topk_lp: list[list[float]] = []
        self.request_ids: list[str] = []
        self.finish = ""  # set when the conversation is over
        self.positions = 0  # tokens of teacher-written turn text
        self.covered = 0  # of those, the ones with a teacher distribution

    def _inject(self, text: str) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.text += text
        self.ids += ids
        self.topk_ids += [[] for _ in ids]
        self.topk_lp += [[] for _ in ids]

    def add_turn(self, turn: TurnResult) -> None:
        """One teacher response: the turns it stands for in the student's format (:func:`call_turns`;
        the toy plays parallel ``tool_calls`` one call per turn, each answered before the next, as the
        data reader interleaves them). Teacher tokens come with a response of one turn only."""
        self.request_ids.append(turn.request_id)
        texts = call_turns(turn, self.fmt)
        results: list[dict[str, Any]] = []
        for j, text in enumerate(texts):
            if j == 0 and turn.token_ids is not None:
                self.positions += len(turn.token_ids)
                self.covered += sum(1 for row in turn.topk_ids if row)
                self.text += text
                self.ids += turn.token_ids
                self.topk_ids += turn.topk_ids
                self.topk_lp += [[round(v, 5) for v in row] for row in turn.topk_logprobs]
            else:  # API tokens not mappable (or none): text-only for this turn
                n = len(self.ids)
                self._inject(text)
                self.positions += len(self.ids) - n
            stopped = turn.finish_reason == "stop" or j < len(texts) - 1
            if stopped:  # the stop token the teacher generated: the template's end of turn
                self.text += self.fmt.end_of_turn
                self.ids.append(self.fmt.end_of_turn_id)
                self.topk_ids.append(list(turn.stop_topk_ids) if j == 0 else [])
                self.topk_lp.append([round(v, 5) for v in turn.stop_topk_logprobs] if j == 0 else [])
            tokens = turn.completion_tokens if j == 0 else 0  # the response's tokens, counted once
            turn_results = self.loop.add_turn(Turn(text=text, tokens=tokens, stopped=stopped))
            if turn_results is None:
                if not stopped:
                    self.finish = "length"
                elif self.loop.answer is not None:
                    self._inject(self.fmt.answer_suffix)  # what the template renders after the answer (toy: <|eos|>)
                    self.finish = "stop"
                else:
                    self.finish = "max_turns"
                return
            self._inject(self.fmt.tool_results_text(turn_results))
            results += turn_results
        self.messages += turn_messages(turn, results)

    def record(self) -> dict[str, Any]:
        decoded = self.tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded != self.text:
            raise AssertionError(f"item {self.item['id']}: completion ids do not decode to the completion text")
        return {
            "id": self.item["id"],
            "prompt_text": self.fmt.prompt(self.item),
            "completion_text": self.text,
            "completion_ids": self.ids,
            "topk_ids": self.topk_ids,
            "topk_logprobs": self.topk_lp,
            "request_id": self.request_ids[0] if self.request_ids else "",
            "request_ids": self.request_ids,
            "calls": [c["call"] for c in self.loop.calls],
            "answer": self.loop.answer,
            "fixture_hits": [c["fixture_hit"] for c in self.loop.calls],
            "finish": self.finish,
        }


# --------------------------------------------------------------------------------------
# Builder


def kd_header(cfg: Config, teacher: Teacher, items: list[dict[str, Any]], chunk: int) -> dict[str, Any]:
    """Everything that determines the KD set's bytes (no timestamps: rebuilds compare equal)."""
    kd, tcfg = cfg.kd, cfg.teacher or TeacherConfig()
    return {
        "__header__": True,
        "kd_version": KD_VERSION,
        "teacher_model_id": teacher.model_id,
        "teacher_kind": tcfg.kind,
        "tokenizer_fingerprint": tokenizer_fingerprint(teacher.tokenizer),
        "tool_registry_sha256": tool_registry_sha256(),
        "prompt_wrapper_sha256": prompt_wrapper_sha256(),
        "items_sha256": sha256_json([[it["id"], it["messages"], it.get("fixtures", [])] for it in items]),
        "top_k": kd.top_k,
        "temperature": kd.temperature,
        "max_new_tokens": kd.max_new_tokens,
        "max_turns": kd.max_turns,
        "chunk": chunk,
        "determinism": tcfg.kind == "openai" and tcfg.api.determinism,
        # false: no teacher top-k anywhere (teacher.api.logprobs off); training then uses sequence-level KD
        "logprobs": tcfg.kind == "local" or tcfg.api.logprobs,
        "total": len(items),
    }


def _dumps(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class _KDState(TypedDict):
    """Build progress saved in the checkpoint (JSON)."""

    header_sha256: str
    n_done: int  # items written
    offset: int  # bytes of the .partial file the checkpoint vouches for
    prefix_sha256: str  # sha256 of those bytes
    tokens: int  # teacher tokens spent
    usd: float  # teacher spend
    positions: int  # student positions of teacher-written turn text
    covered: int  # of those, the ones carrying a teacher distribution


def _save_ckpt(path: Path, state: _KDState) -> None:
    atomic_write_json(path, {"version": CKPT_VERSION, "sha256": sha256_json(state), "state": state})


def _load_ckpt(path: Path) -> _KDState:
    try:
        data = json.loads(path.read_text())
        state: _KDState = data["state"]
        digest = data["sha256"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise KDCheckpointError(
            f"{path}: corrupted checkpoint (not a checkpoint JSON: {err}); delete it to rebuild"
        ) from err
    if data.get("version") != CKPT_VERSION:
        raise KDCheckpointError(
            f"{path}: checkpoint version {data.get('version')!r}, expected {CKPT_VERSION} (written by another "
            "distillgates); delete it and the .partial file to rebuild"
        )
    if sha256_json(state) != digest:
        raise KDCheckpointError(
            f"{path}: corrupted checkpoint (checksum mismatch); delete it and the .partial to rebuild"
        )
    return state


class _Progress:
    """The shared progress bar with the spend so far."""

    def __init__(self, enabled: bool, total: int, done: int) -> None:
        from distillgates.progress import ProgressBar

        self.bar = ProgressBar("KD set", total, completed=done, enabled=enabled, spent="")

    def update(self, done: int, spent: str) -> None:
        self.bar.update(completed=done, spent=spent)

    def close(self) -> None:
        self.bar.close()


class _TurnArgs(TypedDict):
    """Keyword arguments of ``Teacher.complete``/``complete_batch`` after the messages."""

    max_new_tokens: int
    top_k: int
    temperature: float


def _complete_all(
    teacher: Teacher, cfg: KDConfig, cache: ResponseCache | None, conversations: list[KDConversation],
    student_tokenizer: str,
) -> tuple[list[TurnResult], list[bool]]:  # fmt: skip
    """Turns for every conversation: cache hits first, the misses in one batch (or one by one, with
    the item's tools). ``student_tokenizer``: its fingerprint, part of the cache key."""
    kwargs: _TurnArgs = {"max_new_tokens": cfg.max_new_tokens, "top_k": cfg.top_k, "temperature": cfg.temperature}
    payload_of = getattr(teacher, "payload", None)
    keys = [
        cache_key(teacher.model_id, payload_of(c.messages, **kwargs, tools=c.tools) if payload_of
                  else {"messages": c.messages, **kwargs}, student_tokenizer)
        for c in conversations
    ]  # fmt: skip
    results: list[TurnResult | None] = [cache.get(k) if cache else None for k in keys]
    cached = [r is not None for r in results]
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        if isinstance(teacher, BatchTeacher):  # a local teacher
            fresh = teacher.complete_batch([conversations[i].messages for i in missing], **kwargs,
                                           tools=[conversations[i].tools for i in missing])  # fmt: skip
        else:
            fresh = [teacher.complete(conversations[i].messages, **kwargs, tools=conversations[i].tools)
                     for i in missing]  # fmt: skip
        for i, turn in zip(missing, fresh):
            results[i] = turn
            if cache is not None:
                cache.put(keys[i], turn)
    return [r for r in results if r is not None], cached


def play_chunk(
    teacher: Teacher, cfg: KDConfig, cache: ResponseCache | None, items: list[dict[str, Any]],
    student_tokenizer: str,
) -> tuple[list[KDConversation], int, float]:  # fmt: skip
    """The conversations of ``items``, played together, and the tokens / USD spent on uncached requests
    (``student_tokenizer``: the fingerprint of ``teacher.tokenizer``, for the cache keys)."""
    convs = [KDConversation(item, teacher.tokenizer, cfg.max_turns) for item in items]
    tokens, usd = 0, 0.0
    while active := [c for c in convs if not c.finish]:
        turns, cached = _complete_all(teacher, cfg, cache, active, student_tokenizer)
        for conv, turn, hit in zip(active, turns, cached):
            conv.add_turn(turn)
            if not hit:
                tokens += turn.prompt_tokens + turn.completion_tokens
                usd += (turn.prompt_tokens * cfg.usd_per_1k_prompt_tokens
                        + turn.completion_tokens * cfg.usd_per_1k_completion_tokens) / 1000  # fmt: skip
    return convs, tokens, usd


def build_kd_set(
    cfg: Config,
    teacher: Teacher,
    items: list[dict[str, Any]],
    out_path: str | Path,
    *,
    resume: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> KDBuildResult:
    """Build (or resume) the KD set for ``items`` (the first ``kd.items`` of them) at ``out_path``.

    Raises:
        KDCheckpointError: ``resume`` found a corrupted checkpoint or one of another build.
        ValueError: duplicate item ids.
    """
    kd = cfg.kd
    items = items[: kd.items] if kd.items else items
    ids = [it["id"] for it in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate item id {dup!r}: KD records are keyed by id")
    out = Path(out_path)
    partial, ckpt = Path(f"{out}.partial"), Path(f"{out}.ckpt")
    chunk = kd.batch_size if isinstance(teacher, BatchTeacher) else 1
    ckpt_every = -(-kd.ckpt_every // chunk) * chunk  # a multiple of the chunk: resumes re-run whole chunks
    header = kd_header(cfg, teacher, items, chunk)
    header_key = sha256_json(header)
    cache = ResponseCache(cache_dir) if cache_dir is not None else None
    total = len(items)

    state: _KDState = {
        "header_sha256": header_key,
        "n_done": 0,
        "offset": 0,
        "prefix_sha256": "",
        "tokens": 0,
        "usd": 0.0,
        "positions": 0,
        "covered": 0,
    }
    if resume and ckpt.exists():
        state = _resume_state(ckpt, partial, header_key)
        log.info("resuming %s at item %d/%d", out, state["n_done"], total)
    else:
        if resume:
            log.info("no checkpoint at %s: starting %s from scratch", ckpt, out)
        head = _dumps(header)
        partial.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            f.write(head)
            f.flush()
            os.fsync(f.fileno())
        state |= {"offset": len(head), "prefix_sha256": sha256_bytes(head)}
        _save_ckpt(ckpt, state)

    retries0 = getattr(teacher, "retries_done", 0)
    bar = _Progress(progress, total, state["n_done"])
    stopped = ""
    try:
        with open(partial, "r+b") as f:
            f.seek(state["offset"])
            f.truncate()
            prefix = _Hasher(partial, state["offset"])
            while state["n_done"] < total:
                start = state["n_done"]
                convs, tokens, usd = play_chunk(teacher, kd, cache, items[start : start + chunk],
                                                header["tokenizer_fingerprint"])  # fmt: skip
                records = [c.record() for c in convs]
                data = b"".join(_dumps(r) for r in records)
                f.write(data)
                prefix.update(data)
                state["n_done"] += len(records)
                state["tokens"] += tokens
                state["usd"] += usd
                state["positions"] += sum(c.positions for c in convs)
                state["covered"] += sum(c.covered for c in convs)
                bar.update(state["n_done"], f"{state['tokens']} tok ${state['usd']:.4f}")
                stopped = _budget_message(kd, state, total, ckpt)
                if stopped or state["n_done"] % ckpt_every == 0 or state["n_done"] == total:
                    f.flush()
                    os.fsync(f.fileno())
                    state["offset"] = f.tell()
                    state["prefix_sha256"] = prefix.hexdigest()
                    _save_ckpt(ckpt, state)
                if stopped:
                    break
    finally:
        bar.close()
    result = KDBuildResult(
        status="budget_exhausted" if stopped else "complete",
        path=partial if stopped else out,
        n_done=state["n_done"],
        total=total,
        spent_tokens=state["tokens"],
        spent_usd=state["usd"],
        cache_hits=cache.hits if cache else 0,
        retries=getattr(teacher, "retries_done", 0) - retries0,
        message=stopped,
        positions=state["positions"],
        covered=state["covered"],
    )
    if stopped:
        log.warning(stopped)
        return result
    os.replace(partial, out)
    ckpt.unlink(missing_ok=True)
    result.message = (f"KD set complete: {total} items -> {out} ({state['tokens']} tokens, ${state['usd']:.4f}; "
                      f"teacher distribution at {result.coverage:.1%} of {result.positions} student positions)")
    return result


class _Hasher:
    """sha256 of a file prefix, extended as bytes are appended."""

    def __init__(self, path: Path, length: int) -> None:
        import hashlib

        self.h = hashlib.sha256()
        with open(path, "rb") as f:
            self.h.update(f.read(length))

    def update(self, data: bytes) -> None:
        self.h.update(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _resume_state(ckpt: Path, partial: Path, header_key: str) -> _KDState:
    state = _load_ckpt(ckpt)
    if state.get("header_sha256") != header_key:
        raise KDCheckpointError(
            f"{ckpt}: checkpoint belongs to another build (teacher, items or settings changed); "
            "delete it and the .partial file, or restore the original settings"
        )
    if not partial.exists():
        raise KDCheckpointError(f"{ckpt}: checkpoint found but {partial} is missing")
    with open(partial, "rb") as f:
        prefix = f.read(state["offset"])
    if len(prefix) != state["offset"] or sha256_bytes(prefix) != state["prefix_sha256"]:
        raise KDCheckpointError(
            f"{partial}: the first {state['offset']} bytes do not match checkpoint {ckpt.name} (corrupted or truncated)"
        )
    return state


def _budget_message(cfg: KDConfig, state: _KDState, total: int, ckpt: Path) -> str:
    over = []
    if cfg.budget_tokens and state["tokens"] >= cfg.budget_tokens:
        over.append(f"{state['tokens']} tokens >= budget_tokens {cfg.budget_tokens}")
    if cfg.budget_usd and state["usd"] >= cfg.budget_usd:
        over.append(f"${state['usd']:.4f} >= budget_usd ${cfg.budget_usd}")
    if not over or state["n_done"] >= total:
        return ""
    return (
        f"teacher budget reached ({'; '.join(over)}) after {state['n_done']}/{total} items; progress is saved in "
        f"{ckpt} and answered requests in the response cache. Raise kd.budget_tokens/budget_usd and run "
        "`distillgates kd` again to continue (requests already answered are not paid for twice)."
    )


# --------------------------------------------------------------------------------------
# Reading


def _fail(path: Path, line: int, field_name: str, message: str) -> KDSetError:
    return KDSetError(f"{path}:{line}: {field_name}: {message}")


def read_kd_set(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read and validate a KD set: ``(header, records)``.

    Raises:
        KDSetError: naming the file, the line and the field of the first problem.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: KD set not found")
    lines = path.read_bytes().decode("utf-8").splitlines()
    if not lines:
        raise _fail(path, 1, "__header__", "empty file (expected a header line)")
    header = _parse_line(path, 1, lines[0])
    if header.get("__header__") is not True:
        raise _fail(path, 1, "__header__", "first line must be the header ({'__header__': true, ...})")
    for name in HEADER_FIELDS:
        if name not in header:
            raise _fail(path, 1, name, "missing header field")
    if header["kd_version"] != KD_VERSION:
        raise _fail(path, 1, "kd_version", f"expected {KD_VERSION}, got {header['kd_version']!r}")
    records, seen = [], set()
    for n, text in enumerate(lines[1:], start=2):
        record = _parse_line(path, n, text)
        _check_record(path, n, record)
        if record["id"] in seen:
            raise _fail(path, n, "id", f"duplicate id {record['id']!r}")
        seen.add(record["id"])
        records.append(record)
    if len(records) != header["total"]:
        raise _fail(path, len(lines), "total", f"header says {header['total']} records, file has {len(records)}")
    return header, records


def _parse_line(path: Path, n: int, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise _fail(path, n, "<line>", f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise _fail(path, n, "<line>", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_record(path: Path, n: int, record: dict[str, Any]) -> None:
    for name, expected in RECORD_FIELDS.items():
        if name not in record:
            raise _fail(path, n, name, "missing field")
        if not isinstance(record[name], expected):
            raise _fail(path, n, name, f"expected {expected}, got {type(record[name]).__name__}")
    n_tok = len(record["completion_ids"])
    for name in ("topk_ids", "topk_logprobs"):
        if len(record[name]) != n_tok:
            raise _fail(path, n, name, f"has {len(record[name])} positions, completion_ids has {n_tok}")
    for i, (ids, lps) in enumerate(zip(record["topk_ids"], record["topk_logprobs"])):
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            raise _fail(path, n, f"topk_ids[{i}]", "top-k ids and log-probs must be lists of equal length")
    if not all(isinstance(t, int) for t in record["completion_ids"]):
        raise _fail(path, n, "completion_ids", "expected a list of ints")
