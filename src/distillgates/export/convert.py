"""torch.export -> ``run_decompositions({})`` -> ``coremltools.convert`` (mlprogram), plus compression.

Design choices:
- Prefill is exported once with a dynamic length and converted with ``ct.EnumeratedShapes`` over
  the configured lengths (enumerated, not ranged: the ANE compiles enumerated shapes, a range
  forces a dynamic program). Decode is static ``(1, 1)``.
- int8 weights: a weight already on an int8 per-channel grid (QAT-trained) is exported with its
  own grid through coremltools' compression-info buffers (``<module>._COREML_/weight/...``), so
  the stored int8 codes are exactly the QAT codes. Re-quantizing with
  ``linear_quantize_weights`` would pick ``scale = max|w| / 127`` per channel and move every
  weight of a grid with another scale (e.g. the ``max|w| / 127.5`` of a symmetric qint8
  observer). Weights not on a grid are post-training quantized with ``linear_quantize_weights``
  (int8, symmetric, per output channel).
- int4 weights are post-training quantized per block (``OpLinearQuantizerConfig(dtype="int4",
  granularity="per_block", block_size=export.int4_block_size)``, symmetric: one fp16 scale per
  ``block_size`` input channels of each output channel), the format Apple's LLM guide and ANEMLL
  ship (``constexpr_blockwise_shift_scale``, macOS 15). QAT trains an int8 per-channel grid only
  (:mod:`distillgates.train.qat`), so an int4 export re-quantizes those weights.
- Palettization (4/6/8 bit) uses ``palettize_weights`` on linear/conv weights.
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
    chunks = [_grid_scale_rows(rows) for rows in w.split(max(1, (1 << 22) // (128 * w.shape[1])))]
    if any(c is None for c in chunks):
        return None
    chosen = torch.cat([c for c in chunks if c is not None])  # (out, 1)
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


def attach_qat_grids(module: nn.Module) -> list[str]:
    """Register coremltools compression-info buffers for every weight on an int8 grid.

    Returns the parameter names that carry an exact grid (the rest are PTQ'd later).
    """
    owners = dict(module.named_modules())
    exact = []
    for name, param in module.named_parameters():  # tied weights appear once, under their first name
        if param.dim() not in (2, 4) or not name.endswith(".weight"):
            continue
        if isinstance(owners[name.rsplit(".", 1)[0]], nn.Embedding):
            continue  # a gather table, not a linear weight (a tied LM head is handled as the embedding)
        scale = int8_grid_scale(param)
        if scale is None:
            continue
        owner = owners[name.rsplit(".", 1)[0]]
        owner.register_buffer("_COREML_/weight/quantization_n_bits", torch.tensor(8))
        owner.register_buffer("_COREML_/weight/quantization_scale", scale.reshape(scale.shape[0], 1).clone())
        owner.register_buffer("_COREML_/weight/compression_type", torch.tensor([3]))  # 3 = QUANTIZATION
        exact.append(name)
    return exact


def compress(mlmodel: ct.models.MLModel, cfg: ExportConfig) -> ct.models.MLModel:
    """Post-training compression (``cfg.quantize``) of linear/conv weights still stored as plain constants."""
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
        op_cfg = cto.OpPalettizerConfig(mode=cfg.palettize_mode, nbits=nbits, granularity="per_tensor",
                                        weight_threshold=1)  # fmt: skip
    # by const name, not op type: a tied embedding feeds a gather and the LM head linear (an op-type
    # config conflicts there), and RoPE tables / masks must stay fp16
    names = {
        op.inputs["weight"].op.name
        for function in mlmodel._mil_program.functions.values()
        for op in function.operations
        if op.op_type in COMPRESSED_OP_TYPES and op.inputs["weight"].op.op_type == "const"
    }
    config = cto.OptimizationConfig(op_name_configs=dict.fromkeys(sorted(names), op_cfg))
    if quantize in ("int8", "int4"):
        return cto.linear_quantize_weights(mlmodel, config=config)
    return cto.palettize_weights(mlmodel, config=config)
