"""KD-set builder: ask a teacher (local or HTTP) to complete every prompt, write a KD JSONL.

Per item the teacher plays the whole assistant side: it generates a turn up to ``<|end|>``; a
tool call gets the result from the item's fixtures injected (``<|tool_result|>..<|end|><|assistant|>``,
exactly as the runtime broker does) and the teacher goes on, until it answers (then ``<|eos|>``),
runs out of tokens, emits an unparsable call, or hits ``teacher.max_turns``.

Record (one JSON line per item, after a header line)::

    id, prompt_text, completion_text, completion_ids, topk_ids, topk_logprobs, request_id,
    request_ids, spans {tool_name, arguments, argument_values, integration, generated:
    [[start, end], ...]}, calls, answer, fixture_hits, finish

- ``completion_ids`` are the teacher's own ids for generated tokens (so they align with its
  top-k) and the tokenizer's ids for injected text; ``decode(completion_ids) == completion_text``
  is checked for every record. They can differ from ``encode(completion_text)`` where the
  teacher chose a non-canonical BPE segmentation.
- ``topk_ids[i]``/``topk_logprobs[i]`` is the teacher's next-token top-k that *predicted*
  ``completion_ids[i]``; it is ``[]`` where the teacher gave none: injected tool results,
  ``<|eos|>``, the ``<|end|>`` of an API teacher (stop sequences are not reported), and every
  token of an API turn whose tokens do not map onto our vocabulary (text-only KD; see
  :mod:`distillgates.teacher.http`). Log-probs are rounded to 5 decimals.
- ``spans`` are character spans of ``completion_text`` in the kinds of
  :mod:`distillgates.data.targets` (see :func:`process_spans`); :func:`token_masks` turns them
  into masks over ``completion_ids``.

Robustness: a SHA-256 keyed response cache (:mod:`.cache`), records appended to
``<out>.partial`` and a checkpoint ``<out>.ckpt`` (atomic JSON with an embedded sha256 of its
state and of the ``.partial`` prefix it vouches for) every ``ckpt_every`` items. ``resume``
truncates ``.partial`` to the checkpointed prefix and continues with the next item: no
duplicates, no gaps, and byte-identical output to an uninterrupted run (items are processed in
the same fixed chunks of ``kd_batch_size``). Budget (tokens, USD) is checked after each chunk;
at the limit the builder checkpoints and stops with a message saying how to continue.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from distillgates.config import Config, TeacherConfig, sha256_json
from distillgates.data.chat import parse_assistant_turn, prompt_wrapper_sha256, render_prompt, tool_result_text
from distillgates.data.registry import canonical_call, tool_registry_sha256
from distillgates.data.targets import SPAN_KINDS, reference_spans
from distillgates.io import atomic_write_json, sha256_bytes
from distillgates.teacher.base import Teacher, TurnResult
from distillgates.teacher.cache import ResponseCache, cache_key
from distillgates.tokenizer import ASSISTANT, END, EOS, TOOL_CALL, TOOL_RESULT, tokenizer_fingerprint

log = logging.getLogger(__name__)

KD_VERSION = 1
CKPT_VERSION = 1
RECORD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "prompt_text": str,
    "completion_text": str,
    "completion_ids": list,
    "topk_ids": list,
    "topk_logprobs": list,
    "request_id": str,
    "request_ids": list,
    "spans": dict,
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

    @property
    def complete(self) -> bool:
        return self.status == "complete"


# --------------------------------------------------------------------------------------
# One conversation


def fixture_result(item: dict[str, Any], call: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The item's fixture result for ``call`` (exact name + arguments), else an error result."""
    for fixture in item.get("fixtures", []):
        if canonical_call(fixture) == canonical_call(call):
            return fixture["result"], True
    return {"error": f"no result for {call.get('name')!r} with these arguments"}, False


@dataclass
class _Conversation:
    item: dict[str, Any]
    tokenizer: Any
    messages: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    ids: list[int] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lp: list[list[float]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    calls: list[dict[str, Any] | None] = field(default_factory=list)
    fixture_hits: list[bool] = field(default_factory=list)
    answer: str | None = None
    finish: str = ""
    generated: list[list[int]] = field(default_factory=list)  # char spans the teacher produced

    def __post_init__(self) -> None:
        self.messages = [dict(m) for m in self.item["messages"]]

    def _inject(self, text: str) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.text += text
        self.ids += ids
        self.topk_ids += [[] for _ in ids]
        self.topk_lp += [[] for _ in ids]

    def add_turn(self, turn: TurnResult, last_turn: bool) -> None:
        self.request_ids.append(turn.request_id)
        turn_start = len(self.text)
        if turn.token_ids is None:  # API tokens not mappable: text-only for this turn
            self._inject(turn.text)
        else:
            self.text += turn.text
            self.ids += turn.token_ids
            self.topk_ids += turn.topk_ids
            self.topk_lp += [[round(v, 5) for v in row] for row in turn.topk_logprobs]
        if turn.finish_reason != "stop":
            self.generated.append([turn_start, len(self.text)])
            self.finish = "length"
            return
        end_id = self.tokenizer.convert_tokens_to_ids(END)
        self.text += END
        self.ids.append(end_id)
        self.topk_ids.append(list(turn.stop_topk_ids))
        self.topk_lp.append([round(v, 5) for v in turn.stop_topk_logprobs])
        parsed = parse_assistant_turn(turn.text)
        if isinstance(parsed, str):
            self.answer = parsed
            self._inject(EOS)  # the reference's final <|eos|> counts as generated (targets.py)
            self.generated.append([turn_start, len(self.text)])
            self.finish = "stop"
            return
        self.generated.append([turn_start, len(self.text)])
        self.calls.append(parsed)
        if parsed is None:
            self.finish = "invalid_call"
            return
        if last_turn:
            self.finish = "max_turns"
            return
        result, hit = fixture_result(self.item, parsed)
        self.fixture_hits.append(hit)
        self._inject(tool_result_text(result))
        self.messages.append({"role": "assistant", "content": turn.text})
        self.messages.append({"role": "tool", "content": json.dumps(result, separators=(",", ":"), ensure_ascii=False)})

    def record(self) -> dict[str, Any]:
        decoded = self.tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded != self.text:
            raise AssertionError(f"item {self.item['id']}: completion ids do not decode to the completion text")
        return {
            "id": self.item["id"],
            "prompt_text": render_prompt(self.item),
            "completion_text": self.text,
            "completion_ids": self.ids,
            "topk_ids": self.topk_ids,
            "topk_logprobs": self.topk_lp,
            "request_id": self.request_ids[0] if self.request_ids else "",
            "request_ids": self.request_ids,
            "spans": process_spans(self.item, self.text, self.calls, self.generated),
            "calls": self.calls,
            "answer": self.answer,
            "fixture_hits": self.fixture_hits,
            "finish": self.finish,
        }


_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]*)"')
_ARGS_RE = re.compile(r'"arguments"\s*:\s*(\{)')


def process_spans(
    item: dict[str, Any], text: str, calls: list[dict[str, Any] | None], generated: list[list[int]]
) -> dict[str, list[list[int]]]:
    """Character spans of ``text`` (the completion) in the kinds of :mod:`distillgates.data.targets`.

    When the teacher's turns are well formed (canonical call JSON, answer ending ``<|end|><|eos|>``)
    the spans come from :func:`distillgates.data.targets.reference_spans`, exactly as for the
    reference. Otherwise a lenient scan: the ``"name"`` value and the ``"arguments"`` object of each
    ``<|tool_call|>`` segment, and the occurrences of integration values in the final answer
    (``argument_values`` stay empty). ``generated`` (teacher-produced text) is always what the
    builder recorded.
    """
    prompt = render_prompt(item)
    pseudo = {**item, "expected_calls": calls, "reference": text}
    try:
        if any(c is None for c in calls):
            raise ValueError("unparsable call")
        ref = reference_spans(pseudo)
        spans = {k: [[a - len(prompt), b - len(prompt)] for a, b in v] for k, v in ref.items()}
    except (ValueError, KeyError, TypeError):
        spans = _lenient_spans(text, item.get("integration_fields", []))
    spans["generated"] = [list(g) for g in generated]
    return spans


def _lenient_spans(text: str, integration_fields: list[str]) -> dict[str, list[list[int]]]:
    spans: dict[str, list[list[int]]] = {kind: [] for kind in SPAN_KINDS}
    for match in re.finditer(re.escape(TOOL_CALL), text):
        start = match.end()
        stop = text.find(END, start)
        segment = text[start : len(text) if stop < 0 else stop]
        name = _NAME_RE.search(segment)
        if name:
            spans["tool_name"].append([start + name.start(1), start + name.end(1)])
        args = _ARGS_RE.search(segment)
        close = segment.rstrip().rfind("}")
        inner_close = segment.rfind("}", 0, close) if close > 0 else -1  # last "}" before the call's own
        if args and inner_close >= args.start(1):
            spans["arguments"].append([start + args.start(1), start + inner_close + 1])
    answer_start = text.rfind(ASSISTANT)
    answer_start = 0 if answer_start < 0 else answer_start + len(ASSISTANT)
    tail = text[answer_start:]
    if TOOL_CALL not in tail and TOOL_RESULT not in tail:
        answer_end = text.find(END, answer_start)
        answer_end = len(text) if answer_end < 0 else answer_end
        for value in sorted({v for v in integration_fields if v}):
            for m in re.finditer(re.escape(value), text[answer_start:answer_end]):
                spans["integration"].append([answer_start + m.start(), answer_start + m.end()])
        spans["integration"].sort()
    return spans


def token_masks(record: dict[str, Any], tokenizer: Any) -> dict[str, list[bool]]:
    """Per span kind, a mask over ``completion_ids`` (a token is in if its characters overlap a span).

    Token character ranges come from decoding ``completion_ids`` cumulatively, so the masks align
    with the teacher's own ids (which may not be the canonical encoding of the text).
    """
    ends, ids = [], record["completion_ids"]
    for i in range(1, len(ids) + 1):
        ends.append(len(tokenizer.decode(ids[:i], skip_special_tokens=False, clean_up_tokenization_spaces=False)))
    starts = [0, *ends[:-1]]
    return {
        kind: [any(s < b and e > a for a, b in ranges) for s, e in zip(starts, ends)]
        for kind, ranges in record["spans"].items()
    }


# --------------------------------------------------------------------------------------
# Builder


def kd_header(cfg: TeacherConfig, teacher: Teacher, items: list[dict[str, Any]], chunk: int) -> dict[str, Any]:
    """Everything that determines the KD set's bytes (no timestamps: rebuilds compare equal)."""
    return {
        "__header__": True,
        "kd_version": KD_VERSION,
        "teacher_model_id": teacher.model_id,
        "teacher_kind": cfg.kind,
        "tokenizer_fingerprint": tokenizer_fingerprint(teacher.tokenizer),
        "tool_registry_sha256": tool_registry_sha256(),
        "prompt_wrapper_sha256": prompt_wrapper_sha256(),
        "items_sha256": sha256_json([[it["id"], it["messages"], it.get("fixtures", [])] for it in items]),
        "top_k": cfg.top_k,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens,
        "max_turns": cfg.max_turns,
        "chunk": chunk,
        "determinism": cfg.determinism,
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
        raise KDCheckpointError(f"{path}: checkpoint version {data.get('version')!r}, expected {CKPT_VERSION}")
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
    teacher: Teacher, cfg: TeacherConfig, cache: ResponseCache | None, conversations: list[list[dict[str, Any]]]
) -> tuple[list[TurnResult], list[bool]]:
    """Turns for every conversation: cache hits first, the misses in one batch (or one by one)."""
    kwargs: _TurnArgs = {"max_new_tokens": cfg.max_new_tokens, "top_k": cfg.top_k, "temperature": cfg.temperature}
    payload_of = getattr(teacher, "payload", None)
    keys = [
        cache_key(teacher.model_id, payload_of(m, **kwargs) if payload_of else {"messages": m, **kwargs})
        for m in conversations
    ]
    results: list[TurnResult | None] = [cache.get(k) if cache else None for k in keys]
    cached = [r is not None for r in results]
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        batch = getattr(teacher, "complete_batch", None)
        if batch is not None:
            fresh = batch([conversations[i] for i in missing], **kwargs)
        else:
            fresh = [teacher.complete(conversations[i], **kwargs) for i in missing]
        for i, turn in zip(missing, fresh):
            results[i] = turn
            if cache is not None:
                cache.put(keys[i], turn)
    return [r for r in results if r is not None], cached


def _run_chunk(
    teacher: Teacher, cfg: TeacherConfig, cache: ResponseCache | None, items: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int, float]:
    """Records for ``items`` and the tokens / USD spent on uncached requests."""
    convs = [_Conversation(item, teacher.tokenizer) for item in items]
    tokens, usd = 0, 0.0
    for turn_index in range(cfg.max_turns):
        active = [c for c in convs if not c.finish]
        if not active:
            break
        turns, cached = _complete_all(teacher, cfg, cache, [c.messages for c in active])
        for conv, turn, hit in zip(active, turns, cached):
            conv.add_turn(turn, last_turn=turn_index == cfg.max_turns - 1)
            if not hit:
                tokens += turn.prompt_tokens + turn.completion_tokens
                usd += (turn.prompt_tokens * cfg.usd_per_1k_prompt_tokens
                        + turn.completion_tokens * cfg.usd_per_1k_completion_tokens) / 1000  # fmt: skip
    return [c.record() for c in convs], tokens, usd


def build_kd_set(
    cfg: Config | TeacherConfig,
    teacher: Teacher,
    items: list[dict[str, Any]],
    out_path: str | Path,
    *,
    resume: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> KDBuildResult:
    """Build (or resume) the KD set for ``items`` (the first ``teacher.kd_items`` of them) at ``out_path``.

    Raises:
        KDCheckpointError: ``resume`` found a corrupted checkpoint or one of another build.
        ValueError: duplicate item ids.
    """
    tcfg = cfg.teacher if isinstance(cfg, Config) else cfg
    if tcfg is None:
        raise ValueError("config has no teacher section")
    items = items[: tcfg.kd_items] if tcfg.kd_items else items
    ids = [it["id"] for it in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"duplicate item id {dup!r}: KD records are keyed by id")
    out = Path(out_path)
    partial, ckpt = Path(f"{out}.partial"), Path(f"{out}.ckpt")
    chunk = tcfg.kd_batch_size if hasattr(teacher, "complete_batch") else 1
    ckpt_every = -(-tcfg.ckpt_every // chunk) * chunk  # a multiple of the chunk: resumes re-run whole chunks
    header = kd_header(tcfg, teacher, items, chunk)
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
                records, tokens, usd = _run_chunk(teacher, tcfg, cache, items[start : start + chunk])
                data = b"".join(_dumps(r) for r in records)
                f.write(data)
                prefix.update(data)
                state["n_done"] += len(records)
                state["tokens"] += tokens
                state["usd"] += usd
                bar.update(state["n_done"], f"{state['tokens']} tok ${state['usd']:.4f}")
                stopped = _budget_message(tcfg, state, total, ckpt)
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
    )
    if stopped:
        log.warning(stopped)
        return result
    os.replace(partial, out)
    ckpt.unlink(missing_ok=True)
    result.message = f"KD set complete: {total} items -> {out} ({state['tokens']} tokens, ${state['usd']:.4f})"
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


def _budget_message(cfg: TeacherConfig, state: _KDState, total: int, ckpt: Path) -> str:
    over = []
    if cfg.budget_tokens and state["tokens"] >= cfg.budget_tokens:
        over.append(f"{state['tokens']} tokens >= budget_tokens {cfg.budget_tokens}")
    if cfg.budget_usd and state["usd"] >= cfg.budget_usd:
        over.append(f"${state['usd']:.4f} >= budget_usd ${cfg.budget_usd}")
    if not over or state["n_done"] >= total:
        return ""
    return (
        f"teacher budget reached ({'; '.join(over)}) after {state['n_done']}/{total} items; progress is saved in "
        f"{ckpt} and answered requests in the response cache. Raise teacher.budget_tokens/budget_usd and run "
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
    text_len = len(record["completion_text"])
    for kind in SPAN_KINDS:
        spans = record["spans"].get(kind)
        if not isinstance(spans, list):
            raise _fail(path, n, f"spans.{kind}", "missing or not a list")
        for span in spans:
            if not (isinstance(span, list) and len(span) == 2 and 0 <= span[0] <= span[1] <= text_len):
                raise _fail(path, n, f"spans.{kind}", f"span {span!r} outside completion_text (length {text_len})")
