"""Parity of the exported programs with the shipped weights (and, on macOS, Core ML) with eager PyTorch.

The reference is always ``Transformer.forward`` without a cache on the unpadded prompt, so the
check covers padding, the position/length inputs and the KV-state hand-off, not only the math.
``program_parity`` runs the ``torch.export`` programs with the weights read back from each function
of the saved package (:mod:`distillgates.export.roundtrip`), so int8/int4/palettized weights are
what it measures: shape ``L`` with the weights of ``prefill_L``, decode with those of ``decode``.
"""

from __future__ import annotations

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


@torch.no_grad()
def coreml_parity(
    package: str | Path, model: Transformer, lengths: list[int], shared_state: bool, compute_units: str = "ALL",
    decode_steps: int = 16, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Core ML (``MLModel.predict`` with state) vs eager PyTorch, through the functions of the multifunction
    ``package`` (each loaded with ``MLModel(path, function_name=...)``); macOS 15+ only.

    Decode continues a prefill in one ``MLState`` when the functions share their state description
    (``shared_state``), else the prefill's state is copied with ``read_state``/``write_state``, as
    :class:`distillgates.runtime.coreml_engine.CoreMLEngine` does. A split head's outputs are
    concatenated as the engine does.
    """
    import coremltools as ct

    from distillgates.export.functions import DECODE, prefill_function
    from distillgates.export.layout import logits_names
    from distillgates.runtime.coreml_engine import join_logits

    model = model.eval()
    cfg = model.config
    names = logits_names(cfg.vocab_size)
    units = getattr(ct.ComputeUnit, compute_units)
    prefill = {n: ct.models.MLModel(str(package), compute_units=units, function_name=prefill_function(n))
               for n in lengths}  # fmt: skip
    decode = ct.models.MLModel(str(package), compute_units=units, function_name=DECODE)
    by_shape: dict[str, float] = {}
    for length in lengths:
        ids = _tokens(cfg.vocab_size, length, seed + length)
        scores = []
        for n in parity_cases(length):
            state = prefill[length].make_state()
            feed = {"input_ids": _pad(ids[:, :n], length).numpy(), "length": np.array([n], dtype=np.int32)}
            got = join_logits(prefill[length].predict(feed, state=state), names)
            scores.append(cosine(got, model(ids[:, :n])[:, -1]))
        by_shape[str(length)] = min(scores)
    n = max(1, min(lengths[0] // 2, cfg.max_seq_len - decode_steps))
    steps = min(decode_steps, cfg.max_seq_len - n)
    ids = _tokens(cfg.vocab_size, n + steps, seed)
    decode_state = decode.make_state()
    prefill_state = decode_state if shared_state else prefill[lengths[0]].make_state()
    feed = {"input_ids": _pad(ids[:, :n], lengths[0]).numpy(), "length": np.array([n], dtype=np.int32)}
    prefill[lengths[0]].predict(feed, state=prefill_state)
    if not shared_state:
        for name in state_names(cfg.n_layers):
            decode_state.write_state(name, prefill_state.read_state(name))
    decode_scores = []
    for t in range(n, n + steps):
        feed = {"input_ids": ids[:, t : t + 1].int().numpy(), "position": np.array([t], dtype=np.int32)}
        got = join_logits(decode.predict(feed, state=decode_state), names)
        decode_scores.append(cosine(got, model(ids[:, : t + 1])[:, -1]))
    return {"cosine_by_shape": by_shape, "decode_cosine": decode_scores, "shared_state": shared_state}
