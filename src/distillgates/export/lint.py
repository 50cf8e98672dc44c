"""Export lints, and the ANE op-eligibility lint of a MIL program.

Each export lint returns a list of messages (empty = clean); :func:`run_lints` collects them and
the export fails on any. :func:`ane_op_lint` is a *lint*, not a residency measurement: it checks
op types, dtypes and shapes against what the ANE runs, from the MIL program alone
(``"source": "op-eligibility lint (static MIL)"``). Its findings are gated by the ``export``
gates; the export itself does not fail on them (the model still runs, on the CPU/GPU). Where
the work really runs is measured only by ``MLComputePlan`` on macOS
(:mod:`distillgates.export.compute_plan`).

Rules used for ANE eligibility (per op), with their sources:
- dtype: the ANE computes in fp16 (and int8-weight constexprs dequantized to fp16). fp32 ops run
  on GPU/CPU, int32 arithmetic (index math) on the CPU. [coremltools guide "Typed Execution";
  apple/ml-ane-transformers README]
- op type: a list of ops the ANE runs (matmul/linear/conv, elementwise, activations, reductions,
  norms, softmax, the macOS 15 fused ``scaled_dot_product_attention``, layout ops). Scatter,
  gather_nd, non_zero, control flow, sorting and dynamic-shape ops (``shape``/``fill``/
  ``band_part``/``range_1d``) are not ANE ops and cut the graph into CPU segments. [coremltools
  torch ``index_put`` comment: "scatter_nd ... falls off ANE"; WWDC24 "Deploy machine learning
  and AI models on-device with Core ML"]
- rank <= 5 and every dimension <= 16384: larger tensors are not placed on the ANE (this is why
  large-vocabulary LM heads are split). [ml-ane-transformers "Deploying Transformers on the
  Apple Neural Engine"; community measurements (e.g. anemll)]

The lint holds the *attention/MLP path* to these rules: the ops that read an activation, a
floating-point tensor computed at run time. Index and mask math (int32/bool, from positions and
lengths) is not on it: it is small, Core ML runs it on the CPU, and the CPU-forcing and
dynamic-shape lints already cover every op of the program.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from coremltools.converters.mil.mil import types
from torch.export import ExportedProgram

ANE_OPS = frozenset(
    {
        "linear", "conv", "matmul", "einsum",
        "add", "sub", "mul", "real_div", "maximum", "minimum", "pow", "sqrt", "rsqrt", "exp", "abs",
        "square", "inverse", "silu", "sigmoid", "tanh", "gelu", "relu", "softmax", "clip",
        "reduce_mean", "reduce_sum", "reduce_max", "reduce_min", "layer_norm", "batch_norm", "instance_norm",
        "scaled_dot_product_attention",
        "transpose", "reshape", "expand_dims", "squeeze", "concat", "split", "slice_by_index",
        "slice_by_size", "tile", "select", "cast", "gather", "identity",
        "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
        "logical_and", "logical_or", "logical_not",
        "read_state", "coreml_update_state", "slice_update",
    }
)  # fmt: skip
CPU_FORCING_OPS = frozenset(
    {
        "scatter", "scatter_nd", "scatter_along_axis", "gather_nd", "non_zero", "while_loop", "cond",
        "argsort", "topk", "non_maximum_suppression", "random_bernoulli", "random_categorical",
        "random_normal", "random_uniform",
    }
)  # fmt: skip
DYNAMIC_SHAPE_OPS = frozenset({"shape", "fill", "fill_like", "band_part", "range_1d"})
ZERO_FLOP_OPS = frozenset(
    {
        "const", "reshape", "transpose", "expand_dims", "squeeze", "concat", "split", "slice_by_index",
        "slice_by_size", "tile", "cast", "gather", "identity", "read_state", "coreml_update_state",
        "slice_update", "shape",
    }
)  # fmt: skip
ANE_MAX_RANK = 5
ANE_MAX_DIM = 16384


def _is_int64(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dtype == torch.int64


def lint_int64_attention(ep: ExportedProgram) -> list[str]:
    """int64 tensors feeding attention (SDPA) or the KV-cache writes.

    int64 has no ANE path: Core ML casts it to int32 at best and otherwise keeps the index math
    on the CPU, splitting the attention graph. Walks the FX graph backwards from every
    ``scaled_dot_product_attention`` node and every mutated KV buffer.
    """
    graph = ep.graph
    mutated = set(ep.graph_signature.buffers_to_mutate)
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    sinks = [n for n in graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    sinks += [n for n in outputs if getattr(n, "name", None) in mutated]
    seen, stack, errors = set(), list(sinks), []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
        if _is_int64(node.meta.get("val")):
            where = next(iter(reversed(list((node.meta.get("nn_module_stack") or {}).values()))), ("<top>",))[0]
            errors.append(f"int64 on attention path: {node.name} ({node.target}) in {where or '<top>'}")
    return sorted(errors)


def _ops(prog: Any) -> Iterable[Any]:
    for function in prog.functions.values():
        yield from function.operations


def lint_mil_ops(prog: Any) -> list[str]:
    """CPU-forcing and dynamic-shape ops left in the MIL program."""
    errors = []
    for op in _ops(prog):
        if op.op_type in CPU_FORCING_OPS:
            errors.append(f"CPU-forcing op {op.op_type} ({op.name}): not an ANE op, splits the graph")
        elif op.op_type in DYNAMIC_SHAPE_OPS:
            errors.append(
                f"dynamic-shape op {op.op_type} ({op.name}): a shape computed at run time "
                "(use enumerated shapes and reshape with -1, not traced sizes)"
            )
    return errors


def prefill_lengths(spec: Any, input_name: str = "input_ids") -> list[int]:
    """Prompt lengths of the ``prefill_*`` functions of a saved multifunction spec: the last dimension
    of each one's ``input_ids`` (-1 for a flexible shape: a prefill function must be static)."""
    lengths = []
    for function in spec.description.functions:
        if not function.name.startswith("prefill_"):
            continue
        feature = next((f for f in function.input if f.name == input_name), None)
        if feature is None:
            raise ValueError(f"function {function.name} has no input named {input_name!r}")
        arr = feature.type.multiArrayType
        lengths.append(-1 if arr.WhichOneof("ShapeFlexibility") else int(arr.shape[-1]))
    return sorted(lengths)


def lint_shapes(spec: Any, lengths: list[int], max_seq_len: int) -> list[str]:
    """The package has one static prefill function per configured length, each within the KV cache."""
    errors = [f"length {n} is outside the KV cache (max_seq_len {max_seq_len})" for n in lengths if n > max_seq_len]
    found = prefill_lengths(spec)
    if found != sorted(lengths):
        extra = sorted(set(found) - set(lengths))
        errors.append(
            f"prefill shapes {found} differ from the enumerated set {sorted(lengths)}"
            + (f" (outside the set: {extra})" if extra else "")
        )
    return errors


# --------------------------------------------------------------------------------------
# ANE op-eligibility lint

LINT_SOURCE = "op-eligibility lint (static MIL)"  # how reports label its figures (vs "MLComputePlan")


def _dims(shape: Iterable[Any], symbol_size: int) -> list[int]:
    return [int(d) if isinstance(d, int) or hasattr(d, "__index__") else symbol_size for d in shape]


def _shape(var: Any, symbol_size: int) -> list[int]:
    shape = getattr(var, "shape", None)
    return _dims(shape, symbol_size) if shape is not None else []


def _dtype(var: Any) -> str:
    return getattr(var.dtype, "__name__", str(var.dtype))


def _is_constant(op: Any) -> bool:
    return op.op_type == "const" or op.op_type.startswith("constexpr_")


def _reads_activation(op: Any) -> bool:
    """Whether ``op`` is on the attention/MLP path: it reads a floating-point tensor computed at run time."""
    for value in op.inputs.values():
        for var in value if isinstance(value, list | tuple) else (value,):  # concat's ``values`` is a tuple
            producer = var.op
            if types.is_float(var.dtype) and var.val is None and (producer is None or not _is_constant(producer)):
                return True
    return False


def _flops(op: Any, symbol_size: int) -> float:
    """Multiply-adds x2 for contractions, one per output element for elementwise/reductions."""
    if op.op_type in ZERO_FLOP_OPS or not op.outputs:
        return 0.0
    out = _shape(op.outputs[0], symbol_size)
    n_out = math.prod(out) if out else 1
    if op.op_type == "linear":
        return 2.0 * n_out * _shape(op.inputs["weight"], symbol_size)[-1]
    if op.op_type == "conv":
        weight = _shape(op.inputs["weight"], symbol_size)
        return 2.0 * n_out * math.prod(weight[1:])
    if op.op_type == "matmul":
        x = _shape(op.inputs["x"], symbol_size)
        transpose_x = bool(op.inputs["transpose_x"].val) if "transpose_x" in op.inputs else False
        return 2.0 * n_out * (x[-2] if transpose_x else x[-1])
    if op.op_type == "scaled_dot_product_attention":
        q, k = _shape(op.inputs["query"], symbol_size), _shape(op.inputs["key"], symbol_size)
        scores = math.prod(q[:-1]) * k[-2]
        return 4.0 * scores * q[-1] + 5.0 * scores  # QK^T and PV, plus the softmax
    biggest = max((math.prod(_shape(v, symbol_size)) for v in op.inputs.values() if hasattr(v, "shape")), default=1)
    return float(max(n_out, biggest))


def _op_reasons(op: Any) -> list[str]:
    """Why the ANE does not run this op (empty: it does): its type or an output dtype."""
    reasons = [f"op {op.op_type} not in the ANE op list"] if op.op_type not in ANE_OPS else []
    for out in op.outputs:
        dtype = _dtype(out)
        if "fp32" in dtype or "int" in dtype:
            reasons.append(f"{dtype} output (ANE computes fp16)")
    return reasons


def _limit_reasons(op: Any, symbol_size: int) -> list[str]:
    """Outputs beyond the ANE's rank or dimension limits (empty: within them)."""
    reasons = []
    for out in op.outputs:
        shape = _shape(out, symbol_size)
        if len(shape) > ANE_MAX_RANK:
            reasons.append(f"rank {len(shape)} > {ANE_MAX_RANK}")
        if any(d > ANE_MAX_DIM for d in shape):
            reasons.append(f"dimension > {ANE_MAX_DIM} in {shape}")
    return reasons


def ane_op_lint(programs: dict[str, Any], symbol_size: int) -> dict[str, Any]:
    """ANE op-eligibility lint over ``programs`` (name -> MIL program); shapes and FLOPs at ``symbol_size``.

    Returns the ``gate_inputs.ane_lint`` block:

    - ``ineligible_ops``: ops on the attention/MLP path the ANE does not run (op type or dtype),
      one message per op naming the program, the op and the reason. Gated: must be empty.
    - ``over_limits``: ops on that path with an output above the ANE's rank or dimension limit
      (``limits``). Gated: must be empty.
    - ``op_eligible_share``: information only, *not residency*: the share of estimated FLOPs (all
      ops, index math included) in ops that pass the rules. A fp16 transformer scores about 1.0
      whatever the device later does with it.
    - ``by_op_type``: per op type, whether every op passed, FLOPs, count, dtypes, max rank, reasons.

    plus ``op_eligible_share_by_program`` and ``symbol_size``.
    """
    by_op: dict[str, dict[str, Any]] = {}
    per_program: dict[str, float] = {}
    ineligible: list[str] = []
    over_limits: list[str] = []
    all_eligible = all_total = 0.0
    for prog_name, prog in programs.items():
        eligible_flops = total_flops = 0.0
        for op in _ops(prog):
            if _is_constant(op):
                continue
            op_reasons, limit_reasons = _op_reasons(op), _limit_reasons(op, symbol_size)
            reasons = op_reasons + limit_reasons
            if _reads_activation(op):
                where = f"{prog_name}: {op.op_type} ({op.name}): "
                if op_reasons:
                    ineligible.append(where + "; ".join(op_reasons))
                if limit_reasons:
                    over_limits.append(where + "; ".join(limit_reasons))
            flops = _flops(op, symbol_size)
            total_flops += flops
            eligible_flops += 0.0 if reasons else flops
            entry = by_op.setdefault(
                op.op_type, {"eligible": True, "flops": 0.0, "count": 0, "dtypes": [], "max_rank": 0, "reasons": []}
            )
            entry["eligible"] = entry["eligible"] and not reasons
            entry["flops"] += flops
            entry["count"] += 1
            for out in op.outputs:
                if _dtype(out) not in entry["dtypes"]:
                    entry["dtypes"].append(_dtype(out))
                entry["max_rank"] = max(entry["max_rank"], len(_shape(out, symbol_size)))
            entry["reasons"] = sorted(set(entry["reasons"]) | set(reasons))
        per_program[prog_name] = eligible_flops / total_flops if total_flops else 0.0
        all_eligible, all_total = all_eligible + eligible_flops, all_total + total_flops
    return {
        "source": LINT_SOURCE,
        "ineligible_ops": ineligible,
        "over_limits": over_limits,
        "limits": {"max_rank": ANE_MAX_RANK, "max_dim": ANE_MAX_DIM},
        "op_eligible_share": all_eligible / all_total if all_total else 0.0,
        "by_op_type": dict(sorted(by_op.items())),
        "op_eligible_share_by_program": per_program,
        "symbol_size": symbol_size,
    }


def run_lints(
    eps: dict[str, ExportedProgram], programs: dict[str, Any], package_spec: Any, lengths: list[int], max_seq_len: int
) -> dict[str, list[str]]:
    """All lints, by name; each a list of messages naming the program (or function) and the offending op."""
    return {
        "int64_on_attention": [f"{name}: {msg}" for name, ep in eps.items() for msg in lint_int64_attention(ep)],
        "mil_ops": [f"{name}: {msg}" for name, prog in programs.items() for msg in lint_mil_ops(prog)],
        "shapes": [f"prefill: {msg}" for msg in lint_shapes(package_spec, lengths, max_seq_len)],
    }
