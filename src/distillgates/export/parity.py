"""Parity of the exported programs with the shipped weights (and, on macOS, Core ML) with eager PyTorch.

The reference is always ``Transformer.forward`` without a cache on the unpadded prompt, so the
check covers padding, the position/length inputs and the KV-state hand-off, not only the math.
``program_parity`` runs the ``torch.export`` programs with the weights read back from the saved
packages (:mod:`distillgates.export.roundtrip`), so int8/palettized weights are what it measures.
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
    modules: dict[str, nn.Module], model: Transformer, lengths: list[int], decode_steps: int = 16, seed: int = 0
) -> dict[str, Any]:
    """Cosine of the prefill/decode ``modules`` vs eager logits per enumerated length, and over
    ``decode_steps`` decode steps (the decode module continues from the prefill's KV state)."""
    model = model.eval()
    cfg = model.config
    prefill, decode = modules["prefill"], modules["decode"]
    by_shape: dict[str, float] = {}
    for length in lengths:
        ids = _tokens(cfg.vocab_size, length, seed + length)
        scores = []
        for n in parity_cases(length):
            got = _joined(prefill(_pad(ids[:, :n], length), torch.tensor([n], dtype=torch.int32)))  # (1, V)
            scores.append(cosine(got, model(ids[:, :n])[:, -1]))
        by_shape[str(length)] = min(scores)
    # decode: prefill a padded prompt, hand the state over, then step token by token
    n = max(1, min(lengths[0] // 2, cfg.max_seq_len - decode_steps))
    steps = min(decode_steps, cfg.max_seq_len - n)
    ids = _tokens(cfg.vocab_size, n + steps, seed)
    prefill(_pad(ids[:, :n], lengths[0]), torch.tensor([n], dtype=torch.int32))
    _copy_states(prefill, decode, cfg.n_layers)
    decode_scores = []
    for t in range(n, n + steps):
        got = _joined(decode(ids[:, t : t + 1].int(), torch.tensor([t], dtype=torch.int32)))  # (1, V)
        decode_scores.append(cosine(got, model(ids[:, : t + 1])[:, -1]))
    return {"cosine_by_shape": by_shape, "decode_cosine": decode_scores}


@torch.no_grad()
def coreml_parity(
    prefill_path: str | Path, decode_path: str | Path, model: Transformer, lengths: list[int],
    decode_steps: int = 16, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Core ML (``MLModel.predict`` with state) vs eager PyTorch; macOS 15+ only.

    The prefill state is handed to the decode model with ``read_state``/``write_state`` (two
    packages share one state layout). A split head's outputs are concatenated as the engine does.
    """
    import coremltools as ct

    from distillgates.export.layout import logits_names
    from distillgates.runtime.coreml_engine import join_logits

    model = model.eval()
    cfg = model.config
    names = logits_names(cfg.vocab_size)
    prefill, decode = ct.models.MLModel(str(prefill_path)), ct.models.MLModel(str(decode_path))
    by_shape: dict[str, float] = {}
    for length in lengths:
        ids = _tokens(cfg.vocab_size, length, seed + length)
        scores = []
        for n in parity_cases(length):
            state = prefill.make_state()
            feed = {"input_ids": _pad(ids[:, :n], length).numpy(), "length": np.array([n], dtype=np.int32)}
            got = join_logits(prefill.predict(feed, state=state), names)
            scores.append(cosine(got, model(ids[:, :n])[:, -1]))
        by_shape[str(length)] = min(scores)
    n = max(1, min(lengths[0] // 2, cfg.max_seq_len - decode_steps))
    steps = min(decode_steps, cfg.max_seq_len - n)
    ids = _tokens(cfg.vocab_size, n + steps, seed)
    prefill_state, decode_state = prefill.make_state(), decode.make_state()
    feed = {"input_ids": _pad(ids[:, :n], lengths[0]).numpy(), "length": np.array([n], dtype=np.int32)}
    prefill.predict(feed, state=prefill_state)
    for name in state_names(cfg.n_layers):
        decode_state.write_state(name, prefill_state.read_state(name))
    decode_scores = []
    for t in range(n, n + steps):
        feed = {"input_ids": ids[:, t : t + 1].int().numpy(), "position": np.array([t], dtype=np.int32)}
        got = join_logits(decode.predict(feed, state=decode_state), names)
        decode_scores.append(cosine(got, model(ids[:, : t + 1])[:, -1]))
    return {"cosine_by_shape": by_shape, "decode_cosine": decode_scores}
