"""The weights a saved ``.mlpackage`` ships, read back into the exported program (no Core ML runtime).

The export parity gate measures what ships: the compressed weights (int8 / int4 / palettized) of
the saved package, not the fp32 program they were converted from. Each function of the
multifunction package is read back on its own, so the check also shows that every function ships
the same weights (:func:`weight_sharing_errors`).

Design choices:
- The MIL program is rebuilt from the files on disk (``milproto.load`` of the saved spec and its
  ``weights/weight.bin``), so the check runs on Linux, where Core ML cannot predict.
- A compressed weight is a ``constexpr_*`` op (``constexpr_blockwise_shift_scale``,
  ``constexpr_lut_to_dense``, ...); its value is coremltools' own dequantization
  (``materialized_val_inference``), in the dtype Core ML dequantizes to (fp16).
- Each weight maps to a parameter of the ``torch.export`` program by the placeholder name the
  converter keeps (``p_core_model_layers_0_attn_q_proj_weight`` plus suffixes such as
  ``_to_fp16_quantized``), else by shape and order (consts the converter folded and renamed).
  A compressed or parameter-named const that maps to no parameter, a parameter found twice, or
  a parameter with no const in the package is an error: a weight the round trip cannot place
  would otherwise be measured at its fp32 value (see ``map_to_parameters``).
- The round-trip module is the exported program's module with those weights swapped in; it
  computes in fp32, so it measures the weights, not fp16 activations (Core ML prediction parity,
  macOS only, measures those).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from distillgates.export.errors import ExportError

SOURCE = "mlpackage_weights_roundtrip"  # gate_inputs.export.source
# what coremltools appends to a const's name: fp16/fp32 casts, then compression
CONVERTER_SUFFIXES = ("_cast_fp16", "_to_fp16", "_cast_fp32", "_to_fp32", "_quantized", "_palettized")


class RoundTripError(ExportError):
    """A saved package's weights cannot be mapped back onto the exported program."""


def package_weights(package: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Weight-like constants of each function of a saved package, dequantized, in program order:
    function name -> value name -> value (a single-function package has one function, ``main``).

    That is every compressed weight (the outermost ``constexpr_*`` op of each) and every float
    ``const`` with more than one element that is not a buffer (``b_...``, RoPE tables) and not an
    input of a compressed weight (codes, scales, palettes).
    """
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
    spec = mlmodel.get_spec()
    program = milproto_load(spec, spec.specificationVersion, file_weights_dir=mlmodel.weights_dir)
    by_function: dict[str, dict[str, np.ndarray]] = {}
    for function_name, function in program.functions.items():
        weights = by_function.setdefault(function_name, {})
        for op in function.operations:
            if _feeds_constexpr(op):
                continue  # codes/scale/palette of a compressed weight, or an inner stage of a nested one
            name = op.outputs[0].name  # the value's name, which the ops that read it use
            if op.op_type.startswith("constexpr_"):
                weights[name] = np.asarray(op.materialized_val_inference())
            elif op.op_type == "const" and not name.startswith("b_"):
                value = op.outputs[0].val
                if isinstance(value, np.ndarray) and value.size > 1 and np.issubdtype(value.dtype, np.floating):
                    weights[name] = value
    return by_function


def _feeds_constexpr(op: Any) -> bool:
    return any(child.op_type.startswith("constexpr_") for child in op.outputs[0].child_ops)


def _placeholder(const_name: str) -> str:
    """``p_core_model_x_weight_to_fp16_quantized`` -> ``p_core_model_x_weight``."""
    name = const_name
    while name.endswith(CONVERTER_SUFFIXES):
        name = name.rsplit("_", 2)[0] if name.endswith(("_fp16", "_fp32")) else name.rsplit("_", 1)[0]
    return name


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def map_to_parameters(
    weights: dict[str, np.ndarray], ep: ExportedProgram, package: str | Path
) -> dict[str, torch.Tensor]:
    """One function's ``package_weights`` -> ``{parameter FQN: fp32 tensor}`` for every parameter of ``ep``
    that ships (``package`` names the package and function in messages).

    By name first: a compressed or ``p_``-named const must name a parameter (tied parameters,
    one tensor under two names, take the same const). Parameters left over are matched by shape
    and order with the unnamed consts (the converter folds e.g. the ANE norm's
    ``weight[None, :, None, None]`` into a new const); this needs exactly as many consts as
    parameters of each shape. A parameter equal to 1 everywhere is allowed to be absent: the
    converter removes a multiply by ones, so nothing ships and the fp32 value is exact. A parameter
    the program never reads (the standard layout's untied ``lm_head`` once split into chunks) is
    left out: it ships nothing and computes nothing.

    Raises:
        RoundTripError: a compressed or parameter-named const maps to no parameter (or has
            another shape), a parameter is found twice, or parameters are left without a const;
            the message names the package and the const/parameter.
    """
    fqn_by_placeholder = {
        spec.arg.name: spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.PARAMETER and spec.target is not None
    }
    read = {node.name for node in ep.graph.nodes if node.op == "placeholder" and node.users}
    unread = {fqn for name, fqn in fqn_by_placeholder.items() if name not in read}  # e.g. an untied head, split
    params = {fqn: ep.state_dict[fqn] for fqn in fqn_by_placeholder.values()}
    aliases: dict[int, list[str]] = {}  # tied parameters: one tensor, several names
    for fqn, tensor in params.items():
        aliases.setdefault(id(tensor), []).append(fqn)
    mapped: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    unnamed: dict[str, np.ndarray] = {}
    for const_name, value in weights.items():
        fqn = fqn_by_placeholder.get(_placeholder(const_name))
        if fqn is None:
            if const_name.startswith("p_") or const_name.endswith(("_quantized", "_palettized")):
                raise RoundTripError(
                    f"{package}: weight const {const_name!r} (shape {list(value.shape)}) maps to no parameter "
                    f"of the exported program (parameters: {sorted(params)})"
                )
            unnamed[const_name] = value
            continue
        if fqn in mapped:
            raise RoundTripError(f"{package}: parameter {fqn} found twice: consts {source[fqn]!r} and {const_name!r}")
        if tuple(value.shape) != tuple(params[fqn].shape):
            raise RoundTripError(
                f"{package}: weight const {const_name!r} has shape {list(value.shape)}, "
                f"parameter {fqn} {list(params[fqn].shape)}"
            )
        for alias in aliases[id(params[fqn])]:
            mapped[alias], source[alias] = torch.from_numpy(value.astype(np.float32)), const_name
    left = [fqn for fqn in params if fqn not in mapped and fqn not in unread and not bool((params[fqn] == 1).all())]
    for shape in dict.fromkeys(_squeezed(tuple(params[fqn].shape)) for fqn in left):
        wanted = [fqn for fqn in left if _squeezed(tuple(params[fqn].shape)) == shape]
        found = [name for name, value in unnamed.items() if _squeezed(value.shape) == shape]
        if len(found) != len(wanted):
            raise RoundTripError(
                f"{package}: no weight const for parameters {wanted} (by name, or by shape {list(shape)} and order: "
                f"{len(found)} unnamed consts {found} for {len(wanted)} parameters)"
            )
        for fqn, const_name in zip(wanted, found, strict=True):
            mapped[fqn] = torch.from_numpy(unnamed[const_name].astype(np.float32).reshape(params[fqn].shape))
    return mapped


def weight_sharing_errors(mapped: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Parameters whose weight read back differs between functions (``function -> FQN -> tensor``; empty: one
    set of weights serves every function, as the multifunction package stores it once)."""
    (first, reference), *others = mapped.items()
    errors = []
    for function, weights in others:
        if sorted(weights) != sorted(reference):
            errors.append(f"functions {first} and {function} ship different parameters: "
                          f"{sorted(set(weights) ^ set(reference))}")  # fmt: skip
            continue
        differ = [fqn for fqn, value in weights.items() if not torch.equal(value, reference[fqn])]
        if differ:
            errors.append(f"functions {first} and {function} ship different weights for {differ}")
    return errors


def roundtrip_module(ep: ExportedProgram, weights: dict[str, torch.Tensor]) -> nn.Module:
    """``ep``'s module with every parameter replaced by ``weights`` (``map_to_parameters``: the dequantized
    weights a package function stores)."""
    source = ep.module()
    # its own buffers (the KV state), not the parameters it replaces: a deep copy of the 135M parameters
    # that are swapped out next cost ~0.5 GB and seconds per function
    module = copy.deepcopy(source, memo={id(source.get_parameter(fqn)): None for fqn in weights})
    for fqn, value in weights.items():
        owner, _, leaf = fqn.rpartition(".")
        setattr(module.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
    return module.eval()
