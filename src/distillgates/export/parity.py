"""Parity of the exported programs with the shipped weights (and, on macOS, Core ML) with eager PyTorch.

The reference is always ``Transformer.forward`` without a cache on the unpadded prompt, so the
check covers padding, the position/length inputs and the KV-state hand-off, not only the math.
``program_parity`` runs the ``torch.export`` programs with the weights read back from each function
of the saved package (:mod:`distillgates.export.roundtrip`), so int8/int4/palettized weights are
what it measures: shape ``L`` with the weights of ``prefill_L``, decode with those of ``decode``.
``runner_parity`` runs the artifact itself through its runtime: Core ML's (macOS) or Core AI's (Linux too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distillgates.export.wrappers import state_names
from distillgates.model import Transformer


def cosine(a: Tensor | np.ndarray, b: Tensor | np.ndarray) -> float:
    a_t, b_t = torch.as_tensor(np.asarray(a, dtype=np.float64)), torch.as_tensor(np.asarray(b, dtype=np.float64))
    return float(F.cosine_similarity(a_t.flatten(), b_t.flatten(), dim=0))


def _joined(logits: Tensor | tuple[Tensor, ...]) -> Tensor:
    """A program's logits ``(1, V)``: a split head's chunks ``(1, V_i)`` concatenated in order."""
    return torch.cat(logits, -1) if isinstance(logits, tuple) else logits


def parity_cases(length: int) -> list[int]:
    """Real-token counts tried per enumerated length: full, and padded to about half."""
    return sorted({length, max(1, length // 2 + 1)})


def _text_tokens(rows: Sequence[Tensor], n: int, offset: int) -> Tensor:
    """``(1, n)`` tokens of real text: a window of the ``rows`` (token ids ``(1, T)``) joined into one stream,
    starting ``offset`` tokens in (wrapping around)."""
    stream = torch.cat([row.reshape(-1) for row in rows])
    if stream.numel() < n:
        stream = stream.repeat(n // stream.numel() + 1)
    start = offset % max(1, stream.numel() - n + 1)
    return stream[start : start + n][None].to(torch.int64)


def _tokens(vocab: int, n: int, seed: int) -> Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _pad(ids: Tensor, length: int) -> Tensor:
    padded = torch.zeros(1, length, dtype=torch.int32)
    padded[0, : ids.shape[1]] = ids[0]
    return padded


def _copy_states(src: nn.Module, dst: nn.Module, n_layers: int) -> None:
    src_buffers, dst_buffers = dict(src.named_buffers()), dict(dst.named_buffers())
    for name in state_names(n_layers):
        dst_buffers[name].copy_(src_buffers[name])


@torch.no_grad()
def program_parity(
    prefill: dict[int, nn.Module], decode: nn.Module, model: Transformer, lengths: list[int],
    decode_steps: int = 16, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Cosine of the ``prefill`` module of each enumerated length and of ``decode`` vs eager logits, the
    latter over ``decode_steps`` decode steps continuing from the shortest prefill's KV state."""
    model = model.eval()
    cfg = model.config
    by_shape: dict[str, float] = {}
    agree: list[bool] = []  # top-1 of the program == top-1 of eager, every case (information, not gated)
    for length in lengths:
        ids = _tokens(cfg.vocab_size, length, seed + length)
        scores = []
        for n in parity_cases(length):
            padded, real = _pad(ids[:, :n], length), torch.tensor([n], dtype=torch.int32)
            got, want = _joined(prefill[length](padded, real)), model(ids[:, :n])[:, -1]  # (1, V) each
            scores.append(cosine(got, want))
            agree.append(bool(got.argmax() == want.argmax()))
        by_shape[str(length)] = min(scores)
    # decode: prefill a padded prompt, hand the state over, then step token by token
    n = max(1, min(lengths[0] // 2, cfg.max_seq_len - decode_steps))
    steps = min(decode_steps, cfg.max_seq_len - n)
    ids = _tokens(cfg.vocab_size, n + steps, seed)
    prefill[lengths[0]](_pad(ids[:, :n], lengths[0]), torch.tensor([n], dtype=torch.int32))
    _copy_states(prefill[lengths[0]], decode, cfg.n_layers)
    decode_scores = []
    for t in range(n, n + steps):
        got = _joined(decode(ids[:, t : t + 1].int(), torch.tensor([t], dtype=torch.int32)))  # (1, V)
        want = model(ids[:, : t + 1])[:, -1]  # (1, V)
        decode_scores.append(cosine(got, want))
        agree.append(bool(got.argmax() == want.argmax()))
    return {"cosine_by_shape": by_shape, "decode_cosine": decode_scores, "top1_agreement": sum(agree) / len(agree)}


def top1_gap(got: Tensor, want: Tensor) -> float:
    """How much eager PyTorch itself preferred its own argmax over the artifact's: ``log p(argmax want) - log p(argmax
    got)`` under ``softmax(want)`` (nats; 0 where the argmaxes agree, small at a near-tie, large for a real flip)."""
    logp = torch.log_softmax(want.float(), -1)
    return float(logp.max() - logp[got.argmax()])


@torch.no_grad()
def runner_parity(
    prefill: Mapping[int, Any], decode: Any, names: Sequence[str], model: Transformer, lengths: list[int],
    shared_state: bool = True, decode_steps: int = 16, seed: int = 0, rows: Sequence[Tensor] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """An exported artifact's own logits vs eager PyTorch, through its package runners
    (:class:`distillgates.runtime.coreml_engine.PackageRunner`: Core ML's ``MLModel.predict``, Core AI's
    runtime): every enumerated length with and without padding, then ``decode_steps`` decode steps
    continuing the shortest length's prefill in its state.

    Decode continues a prefill in one state when the functions share their state description
    (``shared_state``), else the prefill's state is copied over (``read_state``/``write_state``), as
    :class:`distillgates.runtime.coreml_engine.CoreMLEngine` does. A split head's outputs ``names`` are
    concatenated as the engine does. ``top1_agreement``: the share of cases whose argmax is eager's, ``top1_gaps``:
    each case's :func:`top1_gap` (0 where the argmaxes agree);
    ``non_finite``: the cases whose logits hold a NaN or an inf (fp16 overflow). The prompts are windows of
    ``rows`` (real text: token ids ``(1, T)``) where given, the prompts a model is for, else random tokens.
    """
    from distillgates.runtime.coreml_engine import join_logits

    model = model.eval()
    cfg = model.config
    by_shape: dict[str, float] = {}
    agree: list[float] = []  # top1_gap per case
    non_finite = 0  # cases whose logits hold a NaN or an inf (an fp16 overflow)

    def count(logits: Tensor) -> Tensor:
        nonlocal non_finite
        non_finite += int(not bool(torch.isfinite(logits).all()))
        return logits

    for length in lengths:
        ids = _tokens(cfg.vocab_size, length, seed + length) if rows is None else _text_tokens(rows, length, length)
        scores = []
        for n in parity_cases(length):
            state = prefill[length].new_state()
            feed = {"input_ids": _pad(ids[:, :n], length).numpy(), "length": np.array([n], dtype=np.int32)}
            got, want = count(join_logits(prefill[length].predict(feed, state), names)), model(ids[:, :n])[0, -1]
            scores.append(cosine(got, want))
            agree.append(top1_gap(got, want))
        by_shape[str(length)] = min(scores)
    n = max(1, min(lengths[0] // 2, cfg.max_seq_len - decode_steps))
    steps = min(decode_steps, cfg.max_seq_len - n)
    ids = _tokens(cfg.vocab_size, n + steps, seed) if rows is None else _text_tokens(rows, n + steps, 0)
    decode_state = decode.new_state()
    prefill_state = decode_state if shared_state else prefill[lengths[0]].new_state()
    feed = {"input_ids": _pad(ids[:, :n], lengths[0]).numpy(), "length": np.array([n], dtype=np.int32)}
    prefill[lengths[0]].predict(feed, prefill_state)
    if not shared_state:
        for name in state_names(cfg.n_layers):
            decode.write_state(decode_state, name, prefill[lengths[0]].read_state(prefill_state, name))
    decode_scores = []
    for t in range(n, n + steps):
        feed = {"input_ids": ids[:, t : t + 1].int().numpy(), "position": np.array([t], dtype=np.int32)}
        got, want = count(join_logits(decode.predict(feed, decode_state), names)), model(ids[:, : t + 1])[0, -1]
        decode_scores.append(cosine(got, want))
        agree.append(top1_gap(got, want))
    return {"cosine_by_shape": by_shape, "decode_cosine": decode_scores,
            "top1_agreement": sum(gap == 0 for gap in agree) / len(agree), "top1_gaps": agree,
            "shared_state": shared_state, "non_finite": non_finite,
            "prompts": "random tokens" if rows is None else f"windows of {len(rows)} text rows"}  # fmt: skip


def coreml_parity(
    package: str | Path, model: Transformer, lengths: list[int], shared_state: bool, compute_units: str = "ALL",
    decode_steps: int = 16, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Core ML (``MLModel.predict`` with state) vs eager PyTorch (:func:`runner_parity`), through the functions
    of the multifunction ``package`` (each loaded with ``MLModel(path, function_name=...)``); macOS 15+ only."""
    from distillgates.export.functions import DECODE, prefill_function
    from distillgates.export.layout import logits_names
    from distillgates.runtime.coreml_engine import MLPackageRunner

    prefill = {n: MLPackageRunner(package, prefill_function(n), compute_units) for n in lengths}
    decode = MLPackageRunner(package, DECODE, compute_units)
    return runner_parity(prefill, decode, logits_names(model.config.vocab_size), model, lengths, shared_state,
                         decode_steps, seed)  # fmt: skip
