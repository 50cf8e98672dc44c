"""Distillation losses: KD (dense and sparse top-k), CE, process-step, length-aware, early tool call.

All losses are pure tensor functions over student logits ``(B, T, V)`` where position ``t``
predicts token ``t + 1``; masks are ``(B, T)`` floats/bools over *prediction* positions.
Every loss is a mean over the positions (or rows) it applies to and returns exactly 0 (with a
graph, so ``backward`` still works) when nothing applies.

Design choices:
- **KD divergences** are computed from log-probabilities over a last "bucket" dimension, so
  the same code serves dense teacher logits (buckets = vocabulary) and sparse top-k teacher
  log-probs (buckets = k ids + one "rest" bucket). Forward KL is ``KL(teacher || student)``
  (mode covering), reverse KL is ``KL(student || teacher)`` (mode seeking), JSD is the
  symmetric mixture divergence. All are multiplied by ``T^2`` (Hinton et al.) so gradient
  magnitudes do not shrink as the temperature grows.
- **Missing mass of top-k teacher log-probs** (what API teachers return): the teacher's mass
  outside its top-k, ``r = 1 - sum(exp(topk_logprobs))``, is kept as one explicit "rest"
  bucket, and the student's mass outside the same k ids is gathered into its own rest bucket
  (``log(1 - sum p_s[topk])``, computed stably). KD then compares the two ``(k + 1)``-bucket
  distributions. Nothing is renormalised away, so a student that puts mass on tokens the
  teacher rated low is still penalised, and when ``k = V`` the rest buckets are empty and the
  loss equals dense KD exactly. Temperature is applied to the bucket log-probs
  (``log q / T`` renormalised); for the rest bucket this treats its mass as one pseudo-token,
  an approximation that is exact at ``T = 1`` and whenever the rest mass is 0. Rows shorter than
  ``k`` (a teacher with another tokenizer mapped through bytes, :mod:`distillgates.teacher.tokens`)
  are padded with ``-inf`` log-probs; those slots are left out of both sides (:func:`topk_pair`).
- **Length-aware KD** uses the student's per-position stop probability ``h_t`` (probability
  of ``<|end|>`` at each position of an assistant turn, teacher forced). Under this hazard
  model the expected number of emitted tokens is ``E[len] = sum_t S_t + S_end * tail`` with
  survival ``S_t = prod_{j<t} (1 - h_j)``; ``tail`` is the budget the student would ramble on
  for when it does not stop where the sequence ends (``max_new_tokens - turn length``). The
  penalty ``slope * relu((E[len] - L_teacher) / L_teacher - hinge)`` (capped per row at ``cap`` where one is
  set) therefore has a gradient that *raises stop probabilities*, i.e. shortens outputs. A capped row adds
  ``cap`` and no gradient. It is completeness-aware: it applies
  only to rows whose student prediction omits required tool arguments/evidence (see
  :func:`coverage_met`, which reuses the scorer's ``match_call`` and the shared validator);
  rows whose coverage is met are exempt.
- **Early tool-call loss** is CE toward a tool-call prefix (``<|tool_call|>{json}``) placed
  right after ``<|assistant|>``, over the first N completion tokens, only for rows with
  ``tool_should_be_used``, scaled by a ramp ``0 -> weight`` over the first K epochs. The
  target is the teacher's own tool call when it passes the shared validator and the scorer counts it
  right, else the reference call (the JSON prior fallback); see :func:`early_tool_target`.

- **Large vocabularies** (32k-262k): :func:`position_stats` computes what the recipe needs per
  position (CE, early-tool CE, stop probability, KD divergence, the argmax) ``chunk`` positions at a
  time and recomputes each chunk in backward. Given the final hidden states and the LM head's weight
  (``head``), it applies the head itself, chunk by chunk, so the ``(B, T, V)`` logits never exist,
  neither their gradient (the chunked cross-entropy of Liger's fused linear CE and of Apple's Cut
  Cross-Entropy, here for every per-position loss): the price is the head's matmul once more
  in backward. Given logits instead, it writes their gradient into one logits-sized buffer. Either
  way backward allocates no other full-size temporaries (slicing backward would: each slice makes a
  zero-filled tensor of the whole input); the values equal the unchunked losses within float rounding.
  Given the positions the losses read (``positions``: a training row's assistant turns), it computes
  theirs alone, so a row's prompt and padding never meet the head; their rows are gathered once (the
  gather's backward makes the one input-sized buffer).

References: Hinton et al. 2015 (T^2); Agarwal et al. 2024 (GKD: reverse KL/JSD); torchtune
``ForwardKLLoss``; the inference-speed plan (seeds) for the length and early-tool losses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from distillgates.data.chat import ChatFormat

KD_KINDS = ("forward", "reverse", "jsd")


def token_nll(log_probs: Tensor, targets: Tensor) -> Tensor:
    """Per-token negative log-likelihood ``(B, T)`` from log-probs ``(B, T, V)``.

    The recipe computes ``log_softmax`` once and derives CE, process, early-tool and stop
    probabilities from it: for small models the vocabulary passes cost as much as the model.
    """
    return -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Weighted mean of ``values`` over ``mask`` (0/1 or weights); 0 with a graph when empty."""
    w = mask.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1.0)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) over the last dim from log-probs; 0 * log 0 = 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def divergence(teacher_logp: Tensor, student_logp: Tensor, kind: str, beta: float = 0.5) -> Tensor:
    """Per-position divergence ``(...,)`` between two distributions given as log-probs ``(..., K)``.

    ``jsd`` is the generalized Jensen-Shannon divergence of on-policy distillation (Agarwal et al. 2024, eq. 1;
    TRL's ``generalized_jsd_loss``): with the mixture ``M = beta * teacher + (1 - beta) * student``,
    ``beta * KL(teacher || M) + (1 - beta) * KL(student || M)``; ``beta`` 0 is forward KL, 1 reverse KL (the
    limits of the formula vanish, so the endpoints are the KLs, as in TRL), 0.5 the symmetric JSD.
    """
    if kind == "forward" or (kind == "jsd" and beta == 0.0):
        return _kl(teacher_logp, student_logp)
    if kind == "reverse" or (kind == "jsd" and beta == 1.0):
        return _kl(student_logp, teacher_logp)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
        mix = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log1p(-beta)]), dim=0)
        return beta * _kl(teacher_logp, mix) + (1.0 - beta) * _kl(student_logp, mix)
    raise ValueError(f"KD kind must be one of {KD_KINDS}, got {kind!r}")


def kd_loss_dense(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, kind: str = "forward", temperature: float = 1.0,
    beta: float = 0.5,
) -> Tensor:
    """KD against full teacher logits, ``T^2``-scaled, averaged over masked positions.

    Args:
        student_logits: ``(B, T, V)``.
        teacher_logits: ``(B, T, V)`` (no grad needed).
        mask: ``(B, T)`` positions that receive KD.
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (B, T, V)
    return masked_mean(divergence(t, s, kind, beta), mask) * temperature**2


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_buckets(logp_topk: Tensor) -> Tensor:
    """Append the rest bucket: ``(..., k)`` log-probs -> ``(..., k + 1)`` (rest = 1 - sum)."""
    total = torch.logsumexp(logp_topk, dim=-1, keepdim=True)  # (..., 1)
    # a top-k sum within fp32 rounding of 1 (e.g. k = V) means "no rest mass": use a finite
    # log(~1e-35) rather than -inf, so no inf - inf reaches the divergence or its gradient, and
    # tempering (x / T) keeps it negligible
    full = total > -1e-6
    rest = torch.where(full, torch.full_like(total, -80.0), _log1mexp(total.clamp(max=-1e-6)))  # (..., 1)
    return torch.cat([logp_topk, rest], dim=-1)


_PAD_LOGP = -80.0  # log-prob of a padded top-k slot on both sides: mass ~1e-35, no gradient


def topk_pair(student_logp: Tensor, topk_ids: Tensor, topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher and student ``(..., k + 1)`` bucket log-probs from the student's full log-probs ``(..., V)``
    and the teacher's top-k; slots whose teacher log-prob is ``-inf`` (padding) hold neither side's mass."""
    pad = torch.isneginf(topk_logprobs)  # (..., k)
    s = student_logp.gather(-1, topk_ids).masked_fill(pad, _PAD_LOGP)
    t = topk_logprobs.float().masked_fill(pad, _PAD_LOGP)
    return topk_buckets(t), topk_buckets(s)


def kd_loss_topk(
    student_logits: Tensor,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    mask: Tensor,
    kind: str = "forward",
    temperature: float = 1.0,
) -> Tensor:
    """KD against sparse top-k teacher log-probs with an explicit rest bucket (module docstring).

    Args:
        student_logits: ``(B, T, V)``.
        topk_ids: ``(B, T, k)`` teacher top-k token ids (padding positions: any valid id).
        topk_logprobs: ``(B, T, k)`` teacher log-probs (at temperature 1) of those ids; ``-inf`` = padding.
        mask: ``(B, T)`` positions that receive KD.
    """
    s_full = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, T, V)
    t, s = topk_pair(s_full, topk_ids, topk_logprobs)  # (B, T, k+1) each
    if temperature != 1.0:
        t = F.log_softmax(t / temperature, dim=-1)  # tempered buckets
    return masked_mean(divergence(t, s, kind), mask) * temperature**2


def position_stats(
    x: Tensor,
    targets: Tensor,
    chunk: int,
    *,
    head: Tensor | None = None,
    early_targets: Tensor | None = None,
    stop_ids: Sequence[int] = (),
    topk_ids: Tensor | None = None,
    topk_logprobs: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    teacher_head: Tensor | None = None,
    kind: str = "forward",
    temperature: float = 1.0,
    beta: float = 0.5,
    argmax: bool = False,
    positions: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-position values over the vocabulary, ``chunk`` positions at a time (module docstring).

    Each chunk's logits (with ``head``) and fp32 log-softmax are recomputed in backward instead of
    being kept: peak memory holds one chunk's, not several ``(B, T, V)`` fp32 tensors.

    Args:
        x: ``(B, T, V)`` student logits, or with ``head`` its final hidden states ``(B, T, d)`` (any
            float dtype; each chunk's logits are computed in it, the losses in fp32).
        targets: ``(B, T)`` next tokens.
        chunk: positions (rows of ``B * T``) per chunk.
        head: ``(V, d)`` LM head weight: ``x`` are hidden states and the logits ``x @ head.T`` exist one chunk
            at a time (it receives its gradient too).
        early_targets: ``(B, T)`` early-tool targets (:func:`early_tool_loss`), optional.
        stop_ids: end-of-turn ids (:func:`stop_probability`), optional.
        topk_ids, topk_logprobs: ``(B, T, k)`` sparse teacher (:func:`kd_loss_topk`), or
        teacher_logits: ``(B, T, V)`` dense teacher (:func:`kd_loss_dense`), or with ``teacher_head`` the
            teacher's final hidden states ``(B, T, d_t)``: its logits ``teacher_logits @ teacher_head.T`` (no
            gradient) exist one chunk at a time too.
        argmax: also the student's most likely token per position (``pred``, as float, no gradient).
        positions: ``(B, T)`` bool, the positions whose values are read (a loss's mask): only their logits are
            computed, and the others' values are 0. A training row's prompt (system prompt, tool schemas) and
            padding, most of its positions, then never meet the head.

    Returns:
        ``(B, T)`` tensors: ``nll``, and where asked ``early_nll``, ``stop_prob``, ``kd`` (divergence
        times ``T^2``; its masked mean is the KD loss), ``pred``.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    B, T = targets.shape
    names = ["nll"] + ["early_nll"] * (early_targets is not None) + ["stop_prob"] * bool(stop_ids)
    names += ["kd"] * (topk_ids is not None or teacher_logits is not None) + ["pred"] * argmax
    stop = list(stop_ids)
    t_head = None if teacher_logits is None else _head(teacher_logits, teacher_head)

    def stats(logits: Tensor, target: Tensor, early: Tensor | None, ids: Tensor | None, lps: Tensor | None,
              teacher: Tensor | None) -> Tensor:  # fmt: skip
        lp = F.log_softmax(logits.float(), dim=-1)  # (n, V)
        out = [-lp.gather(-1, target[:, None])[:, 0]]
        if early is not None:
            out.append(-lp.gather(-1, early[:, None])[:, 0])
        if stop:
            out.append(lp[:, stop].exp().sum(-1))
        if ids is not None or teacher is not None:
            s = lp if temperature == 1.0 else F.log_softmax(logits.float() / temperature, dim=-1)  # (n, V)
            if teacher is not None:
                t = F.log_softmax(_logits(teacher, t_head).float() / temperature, dim=-1)  # (n, V)
            else:
                assert ids is not None and lps is not None
                t, s = topk_pair(s, ids, lps)  # (n, k+1) each
                if temperature != 1.0:
                    t = F.log_softmax(t / temperature, dim=-1)
            out.append(divergence(t, s, kind, beta) * temperature**2)
        if argmax:
            out.append(lp.detach().argmax(-1).float())  # exact below 2**24 ids
        return torch.stack(out, dim=-1)  # (n, len(names))

    def rows(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.reshape(B * T, *t.shape[2:])

    flat = [rows(t) for t in (x, targets, early_targets, topk_ids, topk_logprobs, teacher_logits)]
    # none read (a batch without assistant tokens): every position, so the losses keep a graph
    index = None if positions is None or not positions.any() else positions.reshape(-1).nonzero()[:, 0]
    if index is not None:  # the rows a loss reads (a gather: its backward's zero-filled buffer is x's size)
        flat = [None if t is None else t[index] for t in flat]
    table = _ChunkedRows.apply(stats, chunk, flat[0], head, *flat[1:])
    if index is not None:
        table = table.new_zeros(B * T, len(names)).index_copy(0, index, table)
    table = table.view(B, T, len(names))
    return {name: table[..., i] for i, name in enumerate(names)}


class _ChunkedRows(torch.autograd.Function):
    """``fn(logits, *aux)`` over row chunks of the logits and of the ``(rows, ...)`` tensors ``aux``; the logits are
    ``x``, or with a head weight ``w`` the chunk's ``x @ w.T``. Backward recomputes chunk by chunk (see
    :func:`position_stats`) and returns the gradients of ``x`` and ``w``, each in one buffer (the others get none)."""

    @staticmethod
    def forward(ctx: Any, fn: Any, chunk: int, x: Tensor, w: Tensor | None, *aux: Tensor | None) -> Tensor:
        ctx.fn, ctx.chunk = fn, chunk
        ctx.save_for_backward(x, w, *aux)
        head = _head(x, w)
        with torch.no_grad():
            return torch.cat([fn(_logits(x[start : start + chunk], head), *_rows(start, chunk, *aux))
                              for start in range(0, x.shape[0], chunk)])  # fmt: skip

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, w, *aux = ctx.saved_tensors
        grad = torch.empty_like(x)  # (rows, V) logits or (rows, d) hidden states
        grad_w = torch.zeros_like(w) if w is not None and ctx.needs_input_grad[3] else None
        head = _head(x, w)
        for start in range(0, x.shape[0], ctx.chunk):
            part = x[start : start + ctx.chunk]
            with torch.enable_grad():
                logits = _logits(part, head).detach().requires_grad_(True)  # (n, V)
                (g,) = torch.autograd.grad(ctx.fn(logits, *_rows(start, ctx.chunk, *aux)), logits,
                                           grad_out[start : start + ctx.chunk])  # fmt: skip
            if head is None:
                grad[start : start + ctx.chunk] = g
                continue
            grad[start : start + ctx.chunk] = g @ head  # (n, d)
            if grad_w is not None:
                grad_w.addmm_(g.t().to(grad_w.dtype), part.to(grad_w.dtype))  # in place: no (V, d) temporary
        return None, None, grad, grad_w, *[None] * len(aux)


def _head(x: Tensor, w: Tensor | None) -> Tensor | None:
    """The head weight in the hidden states' dtype (bf16 under autocast, as autocast computes a linear), cast once."""
    return None if w is None else w.detach().to(x.dtype)


def _logits(x: Tensor, head: Tensor | None) -> Tensor:
    return x if head is None else F.linear(x, head)  # (n, V)


def _rows(start: int, chunk: int, *tensors: Tensor | None) -> list[Any]:
    return [None if t is None else t[start : start + chunk] for t in tensors]


def ce_loss(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Token CE ``(B, T, V)`` vs ``targets (B, T)`` averaged over ``mask (B, T)``."""
    per_tok = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (B*T,)
    return masked_mean(per_tok.view_as(targets), mask)


def process_loss(logits: Tensor, targets: Tensor, span_mask: Tensor) -> Tensor:
    """Process-step supervision: CE only at the span positions (tool name, JSON args, integration).

    ``span_mask`` is ``(B, T)`` over prediction positions, built from the data's process spans
    (the tokens of those spans are the targets), so each step counts where it actually is.
    Weights other than 0/1 are allowed (e.g. per-kind weights).
    """
    per_tok = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (B*T,)
    w = span_mask.float()
    return (per_tok.view_as(targets) * w).sum() / w.sum().clamp_min(1.0)


# --------------------------------------------------------------------------------------
# Length-aware KD


def expected_length(stop_prob: Tensor, turn_mask: Tensor, turn_start: Tensor, tail: Tensor) -> Tensor:
    """Expected emitted tokens per row under a per-position stop hazard.

    Args:
        stop_prob: ``(B, T)`` student probability of the end-of-turn token at each position.
        turn_mask: ``(B, T)`` bool, positions that generate an assistant turn (the position that
            predicts the turn's first token through the one that predicts its ``<|end|>``).
        turn_start: ``(B, T)`` bool, the first position of each turn (survival restarts there).
        tail: ``(B,)`` tokens the student would still emit per turn if it did not stop at the
            turn's end (generation budget minus turn length, >= 0).

    Returns:
        ``(B,)`` sum over turns of ``sum_t S_t + S_end * tail``.
    """
    m = turn_mask.float()
    log_keep = torch.log1p(-stop_prob.clamp(0.0, 1.0 - 1e-6)) * m  # (B, T)
    incl = log_keep.cumsum(-1)  # (B, T): sum_{j<=t}
    excl = incl - log_keep  # (B, T): sum_{j<t}
    # survival restarts at each turn: subtract the running sum at the turn's first position
    turn_id = turn_start.long().cumsum(-1)  # (B, T): 1..n_turns on turn positions
    base_at_start = torch.where(turn_start, excl, torch.zeros_like(excl))  # (B, T)
    n_turns = int(turn_id.max().item()) + 1
    per_turn_base = excl.new_zeros(excl.shape[0], n_turns).scatter_add(1, turn_id, base_at_start)  # (B, n_turns)
    survive = (excl - per_turn_base.gather(1, turn_id)).exp() * m  # (B, T) S_t
    # the last position of each turn: turn mask set and the next position not in the same turn
    next_in_turn = torch.cat([turn_mask[:, 1:] & ~turn_start[:, 1:], torch.zeros_like(turn_mask[:, :1])], dim=1)
    turn_end = turn_mask & ~next_in_turn  # (B, T)
    survive_after = (incl - per_turn_base.gather(1, turn_id)).exp() * turn_end.float()  # (B, T)
    return survive.sum(-1) + survive_after.sum(-1) * tail  # (B,)


def stop_probability(log_probs: Tensor, stop_ids: Sequence[int]) -> Tensor:
    """``(B, T)`` probability of ending the turn at each position (sum over ``stop_ids``)."""
    return log_probs[..., list(stop_ids)].exp().sum(-1)


def length_loss(
    stop_prob: Tensor,
    turn_mask: Tensor,
    turn_start: Tensor,
    teacher_len: Tensor,
    needs_penalty: Tensor,
    hinge: float = 0.15,
    max_new_tokens: int = 64,
    grad_mask: Tensor | None = None,
    slope: float = 1.0,
    cap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Hinged, completeness-aware length penalty (module docstring).

    Args:
        stop_prob: ``(B, T)`` student stop probability (:func:`stop_probability` of ``<|end|>``).
        turn_mask, turn_start: see :func:`expected_length`.
        teacher_len: ``(B,)`` tokens the teacher emitted for the same prompt (> 0 where used).
        needs_penalty: ``(B,)`` bool: the student's prediction omits required tool
            args/evidence (coverage not met). Rows with coverage met are exempt.
        hinge: relative excess length tolerated before the penalty starts.
        slope: penalty per unit of relative excess beyond the hinge.
        cap: a row's penalty at most this: a row far over its target (a rambling student early in training)
            adds ``cap`` and no gradient, so it cannot dominate the batch; ``None``: uncapped.
        max_new_tokens: generation budget per turn (defines the tail of a student that never stops).
        grad_mask: ``(B, T)`` bool, positions whose stop probability may receive gradient (e.g.
            only after the last required evidence, so the loss never teaches stopping before it);
            ``None``: all positions.

    Returns:
        (loss averaged over penalised rows, expected student length ``(B,)`` for logging).
    """
    if grad_mask is not None:
        stop_prob = torch.where(grad_mask, stop_prob, stop_prob.detach())
    turn_len = turn_mask.float().sum(-1)  # (B,)
    n_turns = turn_start.float().sum(-1).clamp_min(1.0)  # (B,)
    tail = (max_new_tokens - turn_len / n_turns).clamp_min(0.0)  # (B,) per-turn budget left
    exp_len = expected_length(stop_prob, turn_mask, turn_start, tail)  # (B,)
    rel_excess = (exp_len - teacher_len) / teacher_len.clamp_min(1.0)  # (B,)
    active = needs_penalty & (teacher_len > 0)
    penalty = slope * F.relu(rel_excess - hinge)  # (B,)
    if cap is not None:
        penalty = penalty.clamp_max(cap)
    return masked_mean(penalty, active), exp_len.detach()


def turn_masks(input_ids: Tensor, assistant_header: int | Sequence[int], end_id: int) -> tuple[Tensor, Tensor]:
    """Prediction positions of the closed assistant turns of ``input_ids (B, T)``.

    A turn runs from the last token of the assistant header (toy: ``<|assistant|>``; the chat
    format's ``assistant_header_ids``), which predicts the turn's first token, up to the position
    before the end-of-turn token ``end_id`` (which predicts it); a turn cut off by the row's end is
    left out (its length is unknown).

    Returns:
        (turn_mask, turn_start), both ``(B, T)`` bool.
    """
    B, T = input_ids.shape
    header = [assistant_header] if isinstance(assistant_header, int) else list(assistant_header)
    opens = input_ids == header[-1]  # (B, T): the header ends here
    for back, token in enumerate(reversed(header[:-1]), start=1):
        shifted = torch.full_like(input_ids, -1)
        shifted[:, back:] = input_ids[:, :-back]
        opens &= shifted == token
    pos = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
    none = torch.full_like(pos, -1)
    last_asst = torch.where(opens, pos, none).cummax(-1).values  # (B, T)
    last_end = torch.where(input_ids == end_id, pos, none).cummax(-1).values  # (B, T)
    next_end = torch.where(input_ids == end_id, pos, torch.full_like(pos, T)).flip(-1).cummin(-1).values.flip(-1)
    inside = (last_asst > last_end) & (next_end < T)  # (B, T)
    return inside, inside & opens


# --------------------------------------------------------------------------------------
# Coverage (the scorer's check) and early tool call


def coverage_met(item: Mapping[str, Any], calls: Sequence[Mapping[str, Any] | None], answer: str | None) -> bool:
    """True when a prediction covers what the item requires: every expected call matches
    (name, all required args, schema-valid: the scorer's lax :func:`match_call` plus the shared
    :func:`validate_call`) and every integration field shows up in the answer (lax).

    Items without expected calls and integration fields are always covered.
    """
    from distillgates.data.tools import item_tools, validate_call
    from distillgates.eval.matching import call_leniency, match_call, normalize_text, value_text

    expected = list(item.get("expected_calls") or [])
    alternatives, optional = call_leniency(item)
    tools = item_tools(item)
    if len(calls) < len(expected):
        return False
    for pred, exp, alts, opt in zip(calls, expected, alternatives, optional, strict=False):
        if pred is None or validate_call(pred, tools) or match_call(pred, exp, True, tools, alts, opt) is not None:
            return False
    values = integration_values(item)
    if values:
        text = normalize_text(answer or "")
        if not all(normalize_text(value_text(v)) in text for v in values):
            return False
    return True


def integration_values(item: Mapping[str, Any]) -> list[Any]:
    """Values the answer must ground: an integration field names a tool-result key (its value
    is used) or is itself the value."""
    results = [f.get("result") or {} for f in item.get("fixtures") or []]
    out = []
    for name in item.get("integration_fields") or []:
        hits = [r[name] for r in results if isinstance(r, Mapping) and name in r]
        out.extend(hits or [name])
    return out


@dataclass
class EarlyToolTarget:
    """Token ids to supervise right after the prompt's ``<|assistant|>`` and where they came from."""

    ids: list[int]
    source: str  # "teacher" (validated teacher call) or "json_prior" (validated reference call)


def early_tool_target(
    item: Mapping[str, Any], teacher_text: str | None, encode: Any, first_n: int, fmt: ChatFormat | None = None
) -> EarlyToolTarget | None:
    """The tool-call prefix the early-tool loss pulls toward (first ``first_n`` tokens).

    The teacher's first call is used when it parses, passes the shared validator and is right: the
    scorer's lax :func:`match_call` accepts it for the reference's first expected call, or the item has
    none. Otherwise the reference's first expected call (the JSON prior): a teacher's wrong call (an
    operand swapped) would pull the first tokens away from the reference the CE teaches at the same
    positions. ``None`` when the item should not use a tool or no valid call exists. Calls are parsed and
    written in chat format ``fmt`` (default: the toy's, where the target is ``<|tool_call|>{json}``).
    """
    from distillgates.data.chat import toy_chat_format
    from distillgates.data.tools import item_tools, validate_call
    from distillgates.eval.matching import call_leniency, match_call

    if not item.get("tool_should_be_used"):
        return None
    fmt = fmt or toy_chat_format()
    tools = item_tools(item)
    expected = list(item.get("expected_calls") or [])
    reference = expected[0] if expected and not validate_call(expected[0], tools) else None
    if teacher_text is not None:
        calls, _ = fmt.parse_transcript(teacher_text)
        call = calls[0] if calls else None
        alternatives, optional = call_leniency(item)
        if call is not None and not validate_call(call, tools) and (
                reference is None or match_call(call, reference, True, tools, alternatives[0], optional[0]) is None):
            return EarlyToolTarget(list(encode(fmt.call_text(call)))[:first_n], "teacher")
    if reference is not None:
        return EarlyToolTarget(list(encode(fmt.call_text(reference)))[:first_n], "json_prior")
    return None


def early_tool_positions(row_ids: Sequence[int], prompt_len: int, target: Sequence[int]) -> list[tuple[int, int]]:
    """(prediction position, target token) pairs for the early-tool CE on the item's own row.

    Position ``prompt_len - 1 + j`` is conditioned on ``prompt + row[:j]``; it may be taught
    ``target[j]`` only while that prefix equals ``prompt + target[:j]`` (exact teacher forcing).
    So a reference that opens with a preamble teaches just the decision at the first position
    (``<|tool_call|>`` instead of the preamble), and one that opens with the call teaches the
    whole prefix. No second sequence is needed.
    """
    pairs = []
    for j, token in enumerate(target):
        pos = prompt_len - 1 + j
        if pos >= len(row_ids):
            break
        pairs.append((pos, int(token)))
        if prompt_len + j >= len(row_ids) or row_ids[prompt_len + j] != token:
            break  # the row's prefix leaves the target here: later positions see another prefix
    return pairs


def ramp(weight: float, epoch: float, ramp_epochs: float) -> float:
    """Linear ramp ``0 -> weight`` over the first ``ramp_epochs`` epochs (then constant)."""
    if ramp_epochs <= 0:
        return weight
    return weight * min(1.0, max(0.0, epoch / ramp_epochs))


def early_tool_loss(logits: Tensor, targets: Tensor, mask: Tensor, tool_should_be_used: Tensor) -> Tensor:
    """CE toward the tool-call prefix over its (first N) positions, tool rows only.

    Args:
        logits: ``(B, T, V)`` student logits of the rows.
        targets: ``(B, T)`` the tool-call prefix tokens at the positions that should emit them
            (see :func:`early_tool_positions`).
        mask: ``(B, T)`` those positions.
        tool_should_be_used: ``(B,)`` bool; other rows contribute nothing.
    """
    return ce_loss(logits, targets, mask.bool() & tool_should_be_used[:, None])


# --------------------------------------------------------------------------------------
# Combination


def combine(components: Mapping[str, Tensor], weights: Mapping[str, float]) -> tuple[Tensor, dict[str, float]]:
    """Weighted sum of named loss components.

    Returns:
        (total loss tensor, {name: unweighted float value} plus ``"total"``). A component with
        weight 0 is logged but not added (no wasted graph).
    """
    missing = set(weights) - set(components)
    if missing:
        raise ValueError(f"weights given for unknown loss components: {sorted(missing)}")
    total: Tensor | None = None
    for name, value in components.items():
        w = weights.get(name, 0.0)
        if w:
            total = value * w if total is None else total + value * w
    if total is None:
        total = next(iter(components.values())) * 0.0
    logged = {name: float(value.detach()) for name, value in components.items()}
    logged["total"] = float(total.detach())
    return total, logged
