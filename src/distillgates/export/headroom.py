"""fp16 headroom: each layer's peak activation on calibration rows, against fp16's largest finite value.

The ANE computes in fp16 (Core ML's ``compute_precision: fp16``, Core AI's fp16 model): an activation above
65,504 becomes inf and the logits NaN, which no fp32 parity check sees. A PyTorch scan (fp32, eager) records
the largest ``|activation|`` of every module's output and of every linear layer's input (the MLP's gated
product, the attention output before ``o_proj``), over real rows (the training conversations the export
calibrates on), and reports each against the limit with its margin. The ``export`` gate fails when one is over.

Not scanned: values inside a module (an RMSNorm's squares, attention scores before the softmax); the fp16
asset's own outputs are checked for non-finite values by the Core AI parity (``non_finite``).

The fix (``export.fp16_scaling: auto``, ANEMLL's FP16 scaling): the residual stream is what outgrows fp16 (Gemma 3
270M: 103,795 after layer 14 of 18, every fp16 logit NaN), and every norm that reads it is scale-invariant, so
:func:`scale_residual` multiplies the stream by a power of two ``alpha`` (exact in floating point): the embeddings
(``ModelConfig.residual_scale``) and each block's addition to it (Gemma's post-norm weights; other models'
``o_proj`` and ``down_proj`` weights), and the norms that read the stream take ``alpha**2`` times the epsilon: the
same logits, bit for bit in exact arithmetic and within float rounding here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from distillgates.model import Transformer

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
SOURCE = "PyTorch scan (fp32, eager) of module outputs and linear inputs on calibration rows"


@torch.no_grad()
def activation_peaks(model: nn.Module, rows: Sequence[Tensor]) -> dict[str, float]:
    """``{module name: max |output|}`` for every submodule and ``{linear name + ".input": max |input|}`` for every
    ``nn.Linear``, over a forward of each row ``(1, T)`` (token ids)."""
    peaks: dict[str, float] = {}

    def keep(name: str, value: Any) -> None:
        if isinstance(value, Tensor) and value.is_floating_point():
            peaks[name] = max(peaks.get(name, 0.0), float(value.detach().abs().max()))

    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_hook(lambda _m, _a, out, n=name: keep(n, out)))
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda _m, args, n=name: keep(f"{n}.input", args[0])))
    try:
        for row in rows:
            model(row)
    finally:
        for handle in handles:
            handle.remove()
    return peaks


def fp16_headroom(model: nn.Module, rows: Sequence[Tensor]) -> dict[str, Any]:
    """``gate_inputs.fp16_headroom``: every peak, the worst one and its margin (``limit / peak``), the layers over."""
    if not rows:
        raise ValueError("fp16 headroom needs calibration rows (token ids), got none")
    peaks = activation_peaks(model.eval(), rows)
    worst = max(peaks, key=lambda name: peaks[name])
    return {"source": SOURCE, "limit": FP16_MAX, "rows": len(rows), "tokens": sum(r.shape[-1] for r in rows),
            "peaks": peaks, "worst": worst, "max_peak": peaks[worst],
            "margin": FP16_MAX / peaks[worst] if peaks[worst] > 0 else float("inf"),
            "over": sorted(name for name, peak in peaks.items() if peak > FP16_MAX)}  # fmt: skip


RESIDUAL = re.compile(r"layers\.\d+")  # a block's output: the residual stream after it


def residual_alpha(headroom: dict[str, Any], target: float = FP16_MAX / 2) -> float:
    """The power of two (at most 1) that brings the residual stream's peak (the blocks' outputs of a
    :func:`fp16_headroom` scan) to at most ``target``: half fp16's limit by default, for rows the calibration did
    not show."""
    peak = max((v for name, v in headroom["peaks"].items() if RESIDUAL.fullmatch(name)), default=0.0)
    return 1.0 if peak <= target else 2.0 ** math.floor(math.log2(target / peak))


@torch.no_grad()
def scale_residual(model: Transformer, alpha: float) -> Transformer:
    """A model whose residual stream is ``alpha`` (a power of two) times ``model``'s, with the same logits (module
    docstring): the embeddings through ``residual_scale``, each block's addition through its post norms (Gemma) or
    its ``o_proj`` and ``down_proj`` weights; the norms that read the stream take ``alpha**2`` times the epsilon
    (``ModelConfig.residual_norm_eps``), so each computes exactly what it did."""
    if alpha <= 0 or not math.log2(alpha).is_integer():
        raise ValueError(f"alpha must be a power of two (exact in floating point), got {alpha}")
    scaled = Transformer(dataclasses.replace(model.config, residual_scale=model.config.residual_scale * alpha))
    scaled = scaled.to(model.embed.weight.dtype).eval()
    scaled.load_state_dict(model.state_dict())
    for layer in scaled.layers:
        if layer.post_attn_norm is not None and layer.post_mlp_norm is not None:
            layer.post_attn_norm.weight.mul_(alpha)
            layer.post_mlp_norm.weight.mul_(alpha)
        else:
            layer.attn.o_proj.weight.mul_(alpha)
            layer.mlp.down_proj.weight.mul_(alpha)
    return scaled

