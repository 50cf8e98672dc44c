"""torch.export -> ``run_decompositions({})`` -> ``coremltools.convert`` (mlprogram), plus compression.

Design choices:
- Prefill is exported once with a dynamic length and converted with ``ct.EnumeratedShapes`` over
  the configured lengths (enumerated, not ranged: the ANE compiles enumerated shapes, a range
  forces a dynamic program). Decode is static ``(1, 1)``.
- int8 and int4 weights are quantized on our side, before conversion, on the grids of
  :mod:`distillgates.export.grid`: every linear/conv weight gets coremltools' compression-info buffers
  (``<module>._COREML_/weight/quantization_{n_bits,scale}``) and the converter writes the codes straight into
  ``constexpr_blockwise_shift_scale`` ops. That skips coremltools' separate ``linear_quantize_weights`` pass, which
  re-serializes the whole model (a third of the 135M export's CPU time in conversion and compression, see
  benchmarks.md), and keeps the fp32 weights out of the converter's fp16 cast.
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
from distillgates.export.errors import ExportError
from distillgates.export.grid import (
    WeightGrid,
    calibrated_int4_scale,
    quantized_weights,
    weight_grid,
)

COMPRESSED_OP_TYPES = ("linear", "conv")  # ops whose weights are compressed


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


def attach_weight_grids(
    module: nn.Module, quantize: str, int4_block_size: int, input_moments: dict[int, Tensor] | None = None
) -> dict[str, WeightGrid]:
    """Register coremltools compression-info buffers for every linear/conv weight (``quantize`` int8 or int4) on its
    :func:`distillgates.export.grid.weight_grid`; ``{weight name: grid}``.

    int4 with ``input_moments`` (:func:`distillgates.export.grid.input_second_moments`) takes each block's
    :func:`distillgates.export.grid.calibrated_int4_scale`, and the weight is snapped to its grid in place (the
    converter's ``round(w / scale)`` would clip a clipped block's codes to [-8, 7], not [-7, 7]), so calibrate a copy
    of the model. A grid's ``exact``: the weight is exported exactly as it is (on its own int8/int4 grid: QAT).
    """
    grids = {}
    for name, (owner, param) in quantized_weights(module).items():
        calibrated = None
        if quantize == "int4" and input_moments is not None:
            if id(param) not in input_moments:
                raise ExportError(f"export.calibration: no calibration statistics for {name} (layout standard only)")
            calibrated = calibrated_int4_scale(param, int4_block_size, input_moments[id(param)])
        grid = grids[name] = weight_grid(param, quantize, int4_block_size, calibrated)
        if calibrated is not None:
            with torch.no_grad():
                param.copy_(grid.values())
        owner.register_buffer("_COREML_/weight/quantization_n_bits", torch.tensor(8 if quantize == "int8" else 4))
        owner.register_buffer("_COREML_/weight/quantization_scale", grid.scale.clone())
        owner.register_buffer("_COREML_/weight/compression_type", torch.tensor([3]))  # 3 = QUANTIZATION
    return grids


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
