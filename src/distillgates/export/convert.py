"""torch.export -> ``run_decompositions({})`` -> ``coremltools.convert`` (mlprogram), plus compression.

Design choices:
- Prefill is exported once with a dynamic length and converted with ``ct.EnumeratedShapes`` over
  the configured lengths (enumerated, not ranged: the ANE compiles enumerated shapes, a range
  forces a dynamic program). Decode is static ``(1, 1)``.
- int8 and int4 weights are quantized on our side, before conversion: every linear/conv weight gets
  coremltools' compression-info buffers (``<module>._COREML_/weight/quantization_{n_bits,scale}``)
  and the converter writes the codes straight into ``constexpr_blockwise_shift_scale`` ops. That
  skips coremltools' separate ``linear_quantize_weights`` pass, which re-serializes the whole
  model (a third of the 135M export's CPU time in conversion and compression, see
  benchmarks.md), and keeps the fp32 weights out of the converter's fp16 cast.
- int8: a weight already on an int8 per-channel grid (QAT-trained) keeps its own grid, so the
  stored codes are exactly the QAT codes. Re-quantizing with ``scale = max|w| / 127`` per channel
  would move every weight of a grid with another scale (e.g. the ``max|w| / 127.5`` of a
  symmetric qint8 observer). Other weights get that post-training grid (symmetric, per output
  channel, codes in [-127, 127], as ``linear_quantize_weights(mode="linear_symmetric")``).
- int4 is per block (symmetric, ``scale = fp16(max|block| / 7)``, one scale per
  ``export.int4_block_size`` input channels of each output channel; codes in [-7, 7]): what
  ``OpLinearQuantizerConfig(dtype="int4", granularity="per_block")`` computes, the format Apple's
  LLM guide and ANEMLL ship (macOS 15). :func:`int4_block_grid` owns that grid; int4 QAT
  (:mod:`distillgates.train.qat`) fake-quantizes with it, and its weights ``code * scale`` give
  back the same codes and scales here (the block maximum has code 7, so ``max|block| / 7`` is the
  fp16 scale exactly): the export of a QAT'd model is lossless. With ``export.calibration:
  clip_search`` each block's scale is the clipped one with the least output error on calibration
  rows instead (:func:`calibrated_int4_scale`).
- A weight that is not a module's own parameter (a tied LM head is the embedding table, unless the
  layout splits the head into chunks, which are copies) is left to :func:`compress`, which runs
  coremltools' pass on the consts still stored plain.
- Palettization (4/6/8 bit) uses ``palettize_weights`` on linear/conv weights: one palette per tensor, or
  per ``export.palettize_group_size`` output channels.
- Every op config is keyed by const name, and the same weights give the same codes in every
  function, so the multifunction package's const deduplication stores them once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import coremltools as ct
import numpy as np
import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from distillgates.config import ExportConfig

COMPRESSED_OP_TYPES = ("linear", "conv")  # ops whose weights are compressed


class ExportError(RuntimeError):
    """The export failed: a lint fired, an op does not convert or parity is below threshold."""


def example_inputs(kind: str, length: int) -> tuple[Tensor, Tensor]:
    """Example ``(input_ids, length|position)`` for the prefill/decode wrappers."""
    if kind == "prefill":
        return torch.zeros(1, length, dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    return torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)


def export_program(module: nn.Module, kind: str, lengths: list[int]) -> ExportedProgram:
    """``torch.export`` (dynamic length for prefill) then ``run_decompositions({})``."""
    module = module.eval()
    args = example_inputs(kind, max(lengths))
    dynamic: Any = None
    if kind == "prefill" and len(lengths) > 1:
        # Dim.AUTO: torch infers the range; a named Dim trips a spurious reshape guard in 2.13
        dynamic = ({1: Dim.AUTO}, None)
    with torch.no_grad():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic)
    return ep.run_decompositions({})


def _target(name: str) -> Any:
    try:
        return getattr(ct.target, name)
    except AttributeError as err:
        raise ExportError(f"export.minimum_deployment_target: unknown Core ML target {name!r}") from err


def input_types(kind: str, lengths: list[int]) -> list[ct.TensorType]:
    if kind == "prefill":
        shapes: Any = (1, lengths[0])
        if len(lengths) > 1:
            shapes = ct.EnumeratedShapes(shapes=[(1, n) for n in lengths], default=(1, max(lengths)))
        return [
            ct.TensorType(name="input_ids", shape=shapes, dtype=np.int32),
            ct.TensorType(name="length", shape=(1,), dtype=np.int32),
        ]
    return [
        ct.TensorType(name="input_ids", shape=(1, 1), dtype=np.int32),
        ct.TensorType(name="position", shape=(1,), dtype=np.int32),
    ]


def convert_program(
    ep: ExportedProgram, kind: str, lengths: list[int], cfg: ExportConfig, output_names: Sequence[str] = ("logits",)
) -> ct.models.MLModel:
    """Convert to an mlprogram; the KV buffers become fp16 ``ct.StateType`` states.

    ``output_names`` names the program's outputs in order: ``logits``, or the head chunks
    ``logits_0 ..`` of a split LM head (:func:`distillgates.export.layout.logits_names`).
    """
    precision = ct.precision.FLOAT16 if cfg.compute_precision == "fp16" else ct.precision.FLOAT32
    try:
        return ct.convert(
            ep,
            convert_to="mlprogram",
            inputs=input_types(kind, lengths),
            outputs=[ct.TensorType(name=name) for name in output_names],
            minimum_deployment_target=_target(cfg.minimum_deployment_target),
            compute_precision=precision,
            compute_units=getattr(ct.ComputeUnit, cfg.compute_units),
            skip_model_load=sys.platform != "darwin",  # Core ML cannot load models off macOS
        )
    except NotImplementedError as err:  # coremltools' "Unsupported fx node ..." / op not implemented
        raise ExportError(f"unsupported op in the {kind} program: {err}") from err


# --------------------------------------------------------------------------------------
# QAT grids


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

    Embedding tables are left out (a gather table; a tied LM head is the embedding, left to :func:`compress`).
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


def attach_weight_grids(
    module: nn.Module, quantize: str, int4_block_size: int, input_moments: dict[int, Tensor] | None = None
) -> list[str]:
    """Register coremltools compression-info buffers for every linear/conv weight (``quantize`` int8 or int4).

    int8: a weight on an int8 grid keeps it, the rest get the post-training per-channel grid;
    int4: :func:`int4_block_grid` (a weight on it, e.g. int4 QAT'd, gives back its own codes), with the
    :func:`calibrated_int4_scale` of ``input_moments`` (:func:`input_second_moments`) where given; a
    calibrated weight is snapped to its grid in place (the converter's ``round(w / scale)`` would
    clip a clipped block's codes to [-8, 7], not [-7, 7]), so calibrate a copy of the model.
    Returns the weights exported exactly as they are (on their own int8/int4 grid: QAT).
    """
    exact = []
    for name, (owner, param) in quantized_weights(module).items():
        if quantize == "int8":
            scale = int8_grid_scale(param)
            if scale is not None:
                exact.append(name)
                scale = scale.reshape(scale.shape[0], 1)
            else:
                scale = ptq_scale(param, 8)
            n_bits = 8
        else:
            calibrated = None
            if input_moments is not None:
                if id(param) not in input_moments:
                    raise ExportError(f"export.calibration: no calibration statistics for {name} "
                                      "(layout standard only)")
                calibrated = calibrated_int4_scale(param, int4_block_size, input_moments[id(param)])
            codes, scale = int4_block_grid(param, int4_block_size, calibrated)
            on_grid = (codes * scale[..., None]).reshape(param.shape)
            if calibrated is not None:
                with torch.no_grad():
                    param.copy_(on_grid)
            elif torch.equal(on_grid, param.detach().float()):
                exact.append(name)
            n_bits = 4
        owner.register_buffer("_COREML_/weight/quantization_n_bits", torch.tensor(n_bits))
        owner.register_buffer("_COREML_/weight/quantization_scale", scale.clone())
        owner.register_buffer("_COREML_/weight/compression_type", torch.tensor([3]))  # 3 = QUANTIZATION
    return exact


def compress(mlmodel: ct.models.MLModel, cfg: ExportConfig) -> ct.models.MLModel:
    """Post-training compression (``cfg.quantize``) of linear/conv weights still stored as plain constants
    (for int8/int4 only those :func:`attach_weight_grids` could not reach, such as a tied LM head)."""
    from coremltools.optimize import coreml as cto

    quantize = cfg.quantize
    if quantize == "none":
        return mlmodel
    op_cfg: Any
    if quantize == "int8":
        op_cfg = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=1
        )
    elif quantize == "int4":
        op_cfg = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=cfg.int4_block_size,
            weight_threshold=1,
        )  # fmt: skip
    else:
        nbits = int(quantize.removeprefix("palettize"))
        per: dict[str, Any] = {"granularity": "per_tensor"}
        if cfg.palettize_group_size:
            per = {"granularity": "per_grouped_channel", "group_size": cfg.palettize_group_size, "channel_axis": 0}
        op_cfg = cto.OpPalettizerConfig(mode=cfg.palettize_mode, nbits=nbits, weight_threshold=1, **per)
    # by const name, not op type: a tied embedding feeds a gather and the LM head linear (an op-type
    # config conflicts there), and RoPE tables / masks must stay fp16
    names = {
        op.inputs["weight"].op.name
        for function in mlmodel._mil_program.functions.values()
        for op in function.operations
        if op.op_type in COMPRESSED_OP_TYPES and op.inputs["weight"].op.op_type == "const"
    }
    if not names:  # every weight was quantized at conversion (attach_weight_grids): nothing left to compress
        return mlmodel
    config = cto.OptimizationConfig(op_name_configs=dict.fromkeys(sorted(names), op_cfg))
    if quantize in ("int8", "int4"):
        return cto.linear_quantize_weights(mlmodel, config=config)
    return cto.palettize_weights(mlmodel, config=config)
