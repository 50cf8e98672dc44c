"""Training rows and KD records (batches come from :class:`distillgates.data.shapes.ShapeSampler`).

A *row* is one item rendered as ``prompt + reference`` (token ids), padded to the smallest
enumerated shape that holds it. Every loss reads the same row (one forward per batch):
CE over the assistant turns, process-step CE over the call/argument/integration spans, KD
where the teacher signal applies, the length loss over the assistant turns, and the early
tool-call CE at the first completion positions whose prefix agrees with the tool-call target
(:func:`distillgates.losses.early_tool_positions`).

Offline KD records carry the teacher's top-k log-probs for *its own* completion. Position i
of that completion is conditioned on ``prompt + completion[:i]``, which equals our row's
prefix exactly while the completion agrees with the reference; KD is applied there and
masked after the first disagreement (teacher-forced on a different prefix the teacher's
distribution would be a different one). The disagreement's own position keeps KD (its prefix is
still right) unless the reference's token there is a call or a fact (a process span): there the
teacher's distribution favours its own value, the one the reference's CE contradicts.

A KD set built without log-probs (``teacher.api.logprobs: false``; its header says
``"logprobs": false``) has no top-k to match: training uses *sequence-level* KD instead. The row of
an item the teacher finished (record ``finish: stop``) is ``prompt + the teacher's completion text``,
tokenized by the student's tokenizer, and the CE over its assistant turns is the KD loss (no
process spans: they are the reference's); an item the teacher did not finish keeps its reference.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from distillgates.data.chat import chat_format
from distillgates.losses import early_tool_positions, early_tool_target, turn_masks
from distillgates.tokenizer import ASSISTANT, END, TOOL_CALL


def read_kd_set(path: str | Path, tokenizer: Any = None) -> dict[str, dict[str, Any]]:
    """KD records by item id, read and validated by :func:`distillgates.teacher.kd.read_kd_set`
    (which raises ``KDSetError`` naming file, line and field). Each record gets ``sequence_level``:
    true when the set holds no teacher log-probs (module docstring). With ``tokenizer`` (the student's)
    the set must be on its tokens: its header's ``tokenizer_fingerprint`` is the student's."""
    from distillgates.teacher.kd import KDSetError
    from distillgates.teacher.kd import read_kd_set as read_records
    from distillgates.tokenizer import tokenizer_fingerprint

    header, records = read_records(path)
    if tokenizer is not None and header["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise KDSetError(
            f"{path}:1: tokenizer_fingerprint: the KD set is on tokenizer {header['tokenizer_fingerprint'][:16]}, "
            f"the student's is {tokenizer_fingerprint(tokenizer)[:16]} (another vocabulary or chat template): "
            "rebuild it with the run's tokenizer (delete it and run `distillgates kd`: the KD step writes the set "
            "on the student's tokens whatever the teacher's tokenizer)"
        )
    sequence_level = header.get("logprobs") is False  # sets built before the switch have top-k
    return {rec["id"]: {**rec, "sequence_level": sequence_level} for rec in records}


@dataclass
class Row:
    """One item's tensors before padding (lists; positions are prediction positions)."""

    item: dict[str, Any]
    ids: list[int]
    prompt_len: int
    shape: int
    process: list[int]  # prediction positions whose target token lies in a process span
    kd_ids: list[list[int]] = field(default_factory=list)  # per completion position (aligned prefix)
    kd_logprobs: list[list[float]] = field(default_factory=list)
    teacher_len: float = 0.0  # assistant-turn tokens the teacher emitted (0: unknown)
    evidence_end: int = -1  # prediction position of the last required-evidence token of the answer (-1: none)
    length: int = 0  # tokens of the full conversation before truncation (sampler bucketing)
    early: list[int] = field(default_factory=list)  # tool-call prefix ids for the early-tool loss (may be empty)
    excess: list[int] = field(default_factory=list)  # prediction positions of preamble/filler (see excess_positions)
    # a row the student sampled (train.on_policy): (first prediction position, tokens) of each of its turns, the
    # turn masks whether the turn stopped on <|end|>, another stop id or its budget (turn_masks reads <|end|> only)
    generated: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Batch:
    """Padded tensors of one micro-batch (one row per item)."""

    input_ids: Tensor  # (R, L)
    targets: Tensor  # (R, L) next token (0 where padded)
    ce_mask: Tensor  # (R, L) assistant-turn positions of item rows
    turn_mask: Tensor  # (R, L) bool
    turn_start: Tensor  # (R, L) bool
    process_mask: Tensor  # (R, L)
    kd_mask: Tensor  # (R, L)
    kd_ids: Tensor | None  # (R, L, k)
    kd_logprobs: Tensor | None  # (R, L, k)
    teacher_len: Tensor  # (R,)
    evidence_end: Tensor  # (R,) long, -1 where the item has no answer evidence
    tool: Tensor  # (R,) bool: tool_should_be_used and a valid tool-call target exists
    early_targets: Tensor  # (R, L) tool-call prefix tokens at the positions that should emit them
    early_mask: Tensor  # (R, L) those positions
    items: list[dict[str, Any]]
    shape: int
    on_policy: bool = False  # rows the student sampled (train.on_policy): no reference, the teacher scores them

    @property
    def n_tokens(self) -> int:
        return int(self.ce_mask.sum())


def shape_for(n_tokens: int, lengths: Sequence[int]) -> int:
    """Smallest enumerated shape that holds ``n_tokens`` (the largest if none does)."""
    return next((L for L in lengths if n_tokens <= L), lengths[-1])


PROCESS_KINDS = ("tool_name", "arguments", "integration")  # span kinds of distillgates.data.targets


def without_preamble(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with the reference text before its first ``<|tool_call|>`` removed."""
    reference = item["reference"]
    at = reference.find(TOOL_CALL)
    return {**item, "reference": reference[at:]} if at > 0 else item


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def without_filler(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` with its final answer cut after the sentence that holds the answer's last required evidence
    value (``integration_fields``): what follows that sentence is filler (toy: "Anything else?"), and the
    student learns to close the turn where the facts end. Unchanged when the answer holds no evidence or no
    sentence end follows it."""
    from distillgates.data.targets import find_value

    reference = item["reference"]
    start = reference.rfind(ASSISTANT) + len(ASSISTANT) if ASSISTANT in reference else 0
    stop = reference.find(END, start)
    answer = reference[start : stop if stop >= 0 else len(reference)]
    last = -1  # where the answer's last evidence value ends (the last occurrence of each)
    for value in item.get("integration_fields") or []:
        at = find_value(answer, value)
        while at >= 0:
            last = max(last, at + len(value))
            at = find_value(answer, value, at + 1)
    if last < 0:
        return item
    end = _SENTENCE_END.search(answer, last)
    if end is None or not answer[end.end() :].strip():
        return item
    return {**item, "reference": reference[: start + end.end()] + reference[start + len(answer) :]}


def excess_positions(ids: Sequence[int], prompt_len: int, tool_call_id: int | None) -> list[int]:
    """Prediction positions whose targets the latency objective calls excess: the preamble of a tool
    item, the tokens of the first assistant turn before its call token ``tool_call_id`` (toy
    ``<|tool_call|>``; none when the format opens calls with no single token). Rows of the reference
    lose the preamble instead (:func:`without_preamble`); rows of the teacher's text mask it."""
    if tool_call_id is None:
        return []
    call = next((j for j in range(prompt_len, len(ids)) if ids[j] == tool_call_id), None)
    return [] if call is None else list(range(prompt_len - 1, call - 1))  # position q predicts token q + 1


def build_row(
    item: dict[str, Any],
    tokenizer: Any,
    lengths: Sequence[int],
    kd: Mapping[str, Any] | None = None,
    early_first_n: int = 0,
    mask_excess: bool = False,
) -> Row:
    """Tokenize one item (and align its KD record) into a :class:`Row`.

    With ``mask_excess`` a tool item's row is its reference *without the preamble* (the student
    is trained in the context it generates in: the call first; the teacher's completion and its
    top-k lose the same leading turn text, the rest of its distribution was conditioned on the
    preamble: an approximation) and *without the filler* after the sentence of its last fact
    (:func:`without_filler`: that sentence's end is followed by the end of the turn, a CE target; no
    KD there, the teacher would go on with the filler).
    """
    from distillgates.data.targets import encode_item

    if kd is not None and kd.get("sequence_level") and kd["finish"] == "stop":
        return teacher_row(item, tokenizer, lengths, kd, early_first_n, mask_excess)
    strip = mask_excess and bool(item.get("tool_should_be_used"))
    if strip:
        item = without_filler(without_preamble(item))
    enc = encode_item(tokenizer, item)  # ids of render_conversation(item) + per-kind token masks
    p = enc.prompt_len
    full = enc.input_ids
    ids = full[: lengths[-1]]
    prompt_ids, ref_ids = full[:p], full[p:]
    # the position that predicts token j is j - 1
    process = [j - 1 for j in range(1, len(ids)) if any(enc.masks[k][j] for k in PROCESS_KINDS)]
    evidence = [j - 1 for j in range(1, len(ids)) if enc.masks["integration"][j]]
    shape = shape_for(len(full), lengths)
    row = Row(item=item, ids=ids, prompt_len=p, shape=shape, process=process, evidence_end=max(evidence, default=-1),
              length=len(full))
    fmt = chat_format(tokenizer)
    asst, end, call_id = fmt.assistant_header_ids, fmt.end_of_turn_id, fmt.call_marker_id
    if kd is not None:
        completion = list(kd["completion_ids"])
        row.teacher_len = float(turn_masks(torch.tensor([prompt_ids[-len(asst):] + completion]), asst, end)[0].sum())
        topk_ids, topk_lps = kd["topk_ids"], kd["topk_logprobs"]
        if strip and call_id in completion:
            cut = completion.index(call_id)
            completion, topk_ids, topk_lps = completion[cut:], topk_ids[cut:], topk_lps[cut:]
        agree = 0
        while agree < min(len(completion), len(ref_ids)) and completion[agree] == ref_ids[agree]:
            agree += 1
        n = min(agree + 1, len(completion), len(ids) - p + 1)  # position `agree` still has the right prefix
        if strip and agree < len(completion) and agree < len(ref_ids) and ref_ids[agree] == end \
                and end not in ref_ids[agree + 1 :]:
            n = min(n, agree)  # the answer's end, where the filler was cut: the teacher's next token is no target
        if agree < len(completion) and p + agree - 1 in process:
            n = min(n, agree)  # the teacher departs at a call or fact token: the reference is the truth there
        row.kd_ids = [list(r) for r in topk_ids[:n]]
        row.kd_logprobs = [list(r) for r in topk_lps[:n]]
        teacher_text = kd.get("completion_text")
    else:
        teacher_text = None
    if not row.teacher_len:
        row.teacher_len = float(turn_masks(torch.tensor([prompt_ids[-len(asst):] + ref_ids]), asst, end)[0].sum())
    if early_first_n > 0:
        encode: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        target = early_tool_target(item, teacher_text, encode, early_first_n, chat_format(tokenizer))
        if target is not None:
            row.early = target.ids
    return row


def teacher_row(
    item: dict[str, Any],
    tokenizer: Any,
    lengths: Sequence[int],
    kd: Mapping[str, Any],
    early_first_n: int = 0,
    mask_excess: bool = False,
) -> Row:
    """Sequence-level KD: the row is the prompt and the teacher's completion text (module docstring)."""
    fmt = chat_format(tokenizer)
    prompt_ids = fmt.encode(fmt.prompt(item))
    full = prompt_ids + list(tokenizer.encode(kd["completion_text"], add_special_tokens=False))
    ids, p = full[: lengths[-1]], len(prompt_ids)
    asst, end, call_id = fmt.assistant_header_ids, fmt.end_of_turn_id, fmt.call_marker_id
    row = Row(item=item, ids=ids, prompt_len=p, shape=shape_for(len(full), lengths), process=[], length=len(full))
    row.teacher_len = float(turn_masks(torch.tensor([full[p - len(asst) :]]), asst, end)[0].sum())
    if early_first_n > 0:
        encode: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        target = early_tool_target(item, kd["completion_text"], encode, early_first_n, fmt)
        if target is not None:
            row.early = target.ids
    if mask_excess and item.get("tool_should_be_used"):
        row.excess = excess_positions(ids, p, call_id)
    return row


def collate(rows: Sequence[Row], pad_id: int, assistant_header: int | Sequence[int], end_id: int) -> Batch:
    """Pad rows (all of one shape) into one :class:`Batch`."""
    L = max(r.shape for r in rows)
    R = len(rows)
    k = max((len(top) for r in rows for top in r.kd_ids), default=0)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    kd_mask = torch.zeros(R, L)
    process_mask = torch.zeros(R, L)
    early_mask = torch.zeros(R, L)
    early_targets = torch.zeros(R, L, dtype=torch.long)
    kd_ids = torch.zeros(R, L, k, dtype=torch.long) if k else None
    kd_lp = torch.zeros(R, L, k) if k else None
    teacher_len = torch.zeros(R)
    evidence_end = torch.tensor([r.evidence_end for r in rows], dtype=torch.long)
    tool = torch.zeros(R, dtype=torch.bool)
    keep = torch.ones(R, L)  # 0 at excess positions: no CE/KD/process there
    for i, r in enumerate(rows):
        keep[i, [q for q in r.excess if 0 <= q < L]] = 0.0
        input_ids[i, : len(r.ids)] = torch.tensor(r.ids)
        pos = [q for q in r.process if 0 <= q < L - 1]
        process_mask[i, pos] = 1.0
        teacher_len[i] = r.teacher_len
        if r.kd_ids and kd_ids is not None and kd_lp is not None:
            s = r.prompt_len - 1
            for j, (top, lps) in enumerate(zip(r.kd_ids, r.kd_logprobs, strict=True)):
                if s + j >= L or not top:  # [] = no teacher distribution (injected tool result, <|eos|>)
                    continue
                # a shorter row (mapped from another vocabulary, or alternatives an API teacher could not
                # map) is padded with -inf log-probs: the KD loss leaves those slots out (losses.topk_buckets)
                kd_ids[i, s + j, : len(top)] = torch.tensor(top)
                kd_lp[i, s + j, : len(top)] = torch.tensor(lps)
                kd_lp[i, s + j, len(top) :] = -math.inf
                kd_mask[i, s + j] = 1.0
        if r.early:
            tool[i] = True
            for q, token in early_tool_positions(r.ids, r.prompt_len, r.early):
                early_targets[i, q] = token
                early_mask[i, q] = 1.0
    targets = torch.cat([input_ids[:, 1:], torch.zeros(R, 1, dtype=torch.long)], 1)  # (R, L)
    turn_mask, turn_start = turn_masks(input_ids, assistant_header, end_id)  # (R, L)
    for i, r in enumerate(rows):
        if r.generated:
            turn_mask[i], turn_start[i] = False, False
            for start, n in r.generated:
                if start < len(r.ids) - 1:  # positions whose target (the sampled token) is in the row
                    turn_mask[i, start : min(start + n, len(r.ids) - 1)] = True
                    turn_start[i, start] = True
    return Batch(
        input_ids=input_ids,
        targets=targets,
        ce_mask=turn_mask.float() * keep,
        turn_mask=turn_mask,
        turn_start=turn_start,
        process_mask=process_mask * turn_mask.float() * keep,
        kd_mask=kd_mask * turn_mask.float() * keep,  # KD only where the student generates
        kd_ids=kd_ids,
        kd_logprobs=kd_lp,
        teacher_len=teacher_len,
        evidence_end=evidence_end,
        tool=tool,
        early_targets=early_targets,
        early_mask=early_mask,
        items=[r.item for r in rows],
        shape=L,
    )
