"""The int8/int4 weight grids the export writes and int4 QAT trains on: one owner for both, so a QAT'd weight ships
exactly as it was trained.

Design choices:
- int8 is symmetric per output channel: a weight already on an int8 per-channel grid (QAT-trained) keeps its own
  grid, so the stored codes are exactly the QAT codes. Re-quantizing with ``scale = max|w| / 127`` would move every
  weight of a grid with another scale (e.g. the ``max|w| / 127.5`` of a symmetric qint8 observer). Other weights get
  that post-training grid (codes in [-127, 127], as coremltools' ``linear_quantize_weights(mode="linear_symmetric")``).
- int4 is per block (symmetric, ``scale = fp16(max|block| / 7)``, one scale per ``export.int4_block_size`` input
  channels of each output channel; codes in [-7, 7]): what coremltools' ``OpLinearQuantizerConfig(dtype="int4",
  granularity="per_block")`` computes, the format Apple's LLM guide and ANEMLL ship (macOS 15).
  :func:`int4_block_grid` owns that grid; int4 QAT (:mod:`distillgates.train.qat`) fake-quantizes with it, and its
  weights ``code * scale`` give back the same codes and scales (the block maximum has code 7, so ``max|block| / 7``
  is the fp16 scale exactly): the export of a QAT'd model is lossless. With ``export.calibration: clip_search`` each
  block's scale is the clipped one with the least output error on calibration rows (:func:`calibrated_int4_scale`).
- :func:`weight_grid` is the one choice of grid per weight; both targets take it (the Core ML package through
  :func:`distillgates.export.convert.attach_weight_grids`, the Core AI asset through coreai-opt's parametrizations:
  :func:`distillgates.export.coreai.coreai_modules`).
- This module imports no converter: the student step (int4 QAT) depends on it, and an edit to the conversion does not
  retrain the student.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from distillgates.export.errors import ExportError


def int8_grid_scale(weight: Tensor) -> Tensor | None:
    """Per-output-channel scale ``(out, 1, ...)`` of an int8 symmetric grid ``weight`` lies on, or None.

    A row lies on a grid if ``round(w / s) * s == w`` (within a few fp32 ulps of the row max) for
    ``s = max|w| / m``, some integer ``m <= 128``. The smallest such ``m`` is taken: the coarsest
    grid that reproduces the weights, which is the QAT grid unless every code shares a factor
    (and then both grids give the same values).
    """
    w = weight.detach().float().reshape(weight.shape[0], -1)  # (out, in)
    chunks = []
    for rows in w.split(max(1, (1 << 22) // (128 * w.shape[1]))):
        chunk = _grid_scale_rows(rows)
        if chunk is None:
            return None  # off grid: a trained weight fails on its first rows, so the search stops there
        chunks.append(chunk)
    chosen = torch.cat(chunks)  # (out, 1)
    return chosen.reshape(weight.shape[0], *([1] * (weight.dim() - 1)))


def _grid_scale_rows(w: Tensor) -> Tensor | None:
    """``int8_grid_scale`` for a chunk of rows ``(rows, in)`` (chunked: the search is 128x the rows)."""
    amax = w.abs().amax(1, keepdim=True)  # (rows, 1)
    levels = torch.arange(1, 129, dtype=torch.float32)  # candidate max code magnitudes
    scale = (amax / levels).clamp_min(torch.finfo(torch.float32).tiny)  # (rows, 128)
    codes = torch.round(w[:, None, :] / scale[..., None])  # (rows, 128, in)
    error = (codes * scale[..., None] - w[:, None, :]).abs().amax(-1)  # (rows, 128)
    in_range = (codes.amin(-1) >= -128) & (codes.amax(-1) <= 127)
    ok = (error <= 4 * torch.finfo(torch.float32).eps * amax) & in_range
    if not bool(ok.any(1).all()):
        return None
    first = ok.float().argmax(1)  # (rows,) smallest valid level
    chosen = scale.gather(1, first[:, None])  # (rows, 1)
    return torch.where(amax > 0, chosen, torch.ones_like(chosen))


def ptq_scale(weight: Tensor, n_bits: int, block_size: int | None = None) -> Tensor:
    """Symmetric post-training scale ``(out, 1)`` per output channel, or ``(out, in / block_size)`` per block:
    ``max|w| / (2^(n_bits-1) - 1)`` (1 for an all-zero row or block)."""
    w = weight.detach().float().reshape(weight.shape[0], -1)  # (out, in)
    if block_size is not None:
        if w.shape[1] % block_size:
            raise ExportError(f"int4 per-block: {w.shape[1]} input channels are not a multiple of "
                              f"export.int4_block_size {block_size}")  # fmt: skip
        amax = w.reshape(w.shape[0], -1, block_size).abs().amax(-1)  # (out, in / block)
    else:
        amax = w.abs().amax(1, keepdim=True)  # (out, 1)
    scale = amax / (2 ** (n_bits - 1) - 1)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# fp16's largest finite value: a larger int4 scale would be stored as inf
FP16_MAX = float(torch.finfo(torch.float16).max)


def int4_block_grid(weight: Tensor, block_size: int, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The int4 per-block grid the export writes: codes ``(out, in / block, block)`` in [-7, 7] and the
    fp16-representable scale ``(out, in / block)`` (fp32 tensors).

    ``scale`` defaults to :func:`ptq_scale` (``max|block| / 7``); it is rounded to fp16 as the package
    stores it, and a block whose scale underflows fp16 gets scale 1 (codes 0, as fp16 would store it).
    """
    w = weight.detach().float().reshape(weight.shape[0], -1)  # (out, in)
    scale = ptq_scale(weight, 4, block_size) if scale is None else scale
    scale = scale.clamp(max=FP16_MAX).half().float()  # (out, in / block)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w.reshape(w.shape[0], -1, block_size) / scale[..., None]).clamp(-7, 7)
    return codes, scale


def fake_quantize_int4(weight: Tensor, block_size: int) -> Tensor:
    """``weight`` on :func:`int4_block_grid` (``code * scale``), straight-through gradient (QAT)."""
    codes, scale = int4_block_grid(weight, block_size)
    on_grid = (codes * scale[..., None]).reshape(weight.shape).to(weight.dtype)
    return weight + (on_grid - weight).detach()


def calibrated_int4_scale(weight: Tensor, block_size: int, input_moments: Tensor, candidates: int = 11) -> Tensor:
    """Per-block int4 scale ``(out, in / block)`` chosen by a clipping search on calibration statistics.

    Each block tries ``scale = a * max|block| / 7`` for ``a`` in ``linspace(1, 0.5, candidates)`` and
    keeps the one with the least output error ``e^T H_b e`` (``e``: the block's weight error, ``H_b``:
    ``E[x x^T]`` of its input channels over the calibration tokens, ``input_moments`` ``(in / block,
    block, block)``; the block-diagonal of the layer's input Hessian, as GPTQ's). ``a = 1`` is the
    data-free scale, so the chosen error on the calibration tokens is never larger.
    """
    w = weight.detach().float().reshape(weight.shape[0], -1, block_size)  # (out, nb, block)
    base = ptq_scale(weight, 4, block_size)  # (out, nb)
    best_scale, best_error = base, torch.full_like(base, float("inf"))
    for a in torch.linspace(1.0, 0.5, candidates).tolist():
        codes, scale = int4_block_grid(weight, block_size, base * a)
        error = codes * scale[..., None] - w  # (out, nb, block)
        error = torch.einsum("obi,bij,obj->ob", error, input_moments, error)  # (out, nb)
        better = error < best_error
        best_scale, best_error = torch.where(better, base * a, best_scale), torch.where(better, error, best_error)
    return best_scale


def quantized_weights(module: nn.Module) -> dict[str, tuple[nn.Module, nn.Parameter]]:
    """``{name: (owner, weight)}`` of the linear/conv weights the int8/int4 export quantizes on its own grids.

    Embedding tables are left out (a gather table; a tied LM head is the embedding, left to
    :func:`distillgates.export.convert.compress` in the Core ML package, to the embedding's pass in the Core AI asset).
    """
    owners = dict(module.named_modules())
    chosen = {}
    for name, param in module.named_parameters():  # tied weights appear once, under their first name
        owner = owners[name.rsplit(".", 1)[0]]
        if param.dim() in (2, 4) and name.endswith(".weight") and not isinstance(owner, nn.Embedding):
            chosen[name] = (owner, param)
    return chosen


@torch.no_grad()
def input_second_moments(model: nn.Module, batches: Sequence[Tensor], block_size: int) -> dict[int, Tensor]:
    """``{id(weight): E[x x^T]}`` per block of ``block_size`` input channels, ``(in / block, block, block)``, over
    every token of ``batches`` (token ids, one forward each) for the weight of each linear of ``model`` (a tied
    LM head's is the embedding's): the calibration statistics of :func:`calibrated_int4_scale`."""
    sums: dict[int, Tensor] = {}
    counts: dict[int, int] = {}

    def hook(key: int) -> Any:
        def add(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # (tokens, in): linear inputs
            x = x.reshape(x.shape[0], -1, block_size)  # (tokens, nb, block)
            sums[key] = sums.get(key, 0) + torch.einsum("nbi,nbj->bij", x, x)  # (nb, block, block)
            counts[key] = counts.get(key, 0) + x.shape[0]

        return add

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    hooks = [linear.register_forward_pre_hook(hook(id(linear.weight))) for linear in linears]
    try:
        for batch in batches:
            model(batch)
    finally:
        for handle in hooks:
            handle.remove()
    return {key: total / counts[key] for key, total in sums.items()}


class WeightGrid(NamedTuple):
    """One weight on its int8/int4 grid: integer ``codes`` (fp32) shaped as the weight, ``scale`` ``(out, 1)`` (int8)
    or ``(out, in / block)`` (int4), and ``exact``: the weight already lay on it (QAT), so it ships as it is."""

    codes: Tensor
    scale: Tensor
    exact: bool

    def values(self) -> Tensor:
        """``code * scale``, shaped as the weight."""
        blocks = self.codes.reshape(self.codes.shape[0], self.scale.shape[1], -1)  # (out, scales per row, block)
        return (blocks * self.scale[..., None]).reshape(self.codes.shape)


def weight_grid(weight: Tensor, quantize: str, block_size: int, scale: Tensor | None = None) -> WeightGrid:
    """The grid the export writes for ``weight`` (``quantize`` int8 or int4), data-free unless an int4 ``scale`` is
    given (:func:`calibrated_int4_scale`). int8: the weight's own grid if it lies on one (:func:`int8_grid_scale`),
    else :func:`ptq_scale`; int4: :func:`int4_block_grid`, on which an int4 QAT'd weight gives back its own codes."""
    w = weight.detach().float()
    if quantize == "int8":
        found = int8_grid_scale(w)
        scale8 = ptq_scale(w, 8) if found is None else found.reshape(w.shape[0], 1)
        codes = torch.round(w.reshape(w.shape[0], -1) / scale8).clamp(-128, 127)
        return WeightGrid(codes.reshape(w.shape), scale8, found is not None)
    if quantize != "int4":
        raise ValueError(f"weight_grid: quantize must be int8 or int4, got {quantize!r}")
    codes, scale4 = int4_block_grid(w, block_size, scale)
    grid = WeightGrid(codes.reshape(w.shape), scale4, False)
    return grid._replace(exact=scale is None and torch.equal(grid.values(), w))
