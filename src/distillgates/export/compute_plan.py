"""ANE residency from ``MLComputePlan`` (macOS 14.4+): the only residency figure distillgates reports.

Core ML's compute plan gives, per MIL operation, the preferred compute device and an estimated
relative cost. The residency is the share of estimated cost whose preferred device is the Neural
Engine. It depends on the machine (the OS and chip decide the placement), so its baselines are per
hardware profile. Only runs on macOS (the plan needs the Core ML framework); elsewhere it raises.
The static op-eligibility lint (:func:`distillgates.export.lint.ane_op_lint`) is not a substitute:
it checks op types, dtypes and shapes, not where the work runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PLAN_SOURCE = "MLComputePlan"  # how reports label its figures (vs "op-eligibility lint (static MIL)")
# the gate_inputs key of the residency (macOS): one entry per function of the package, written by the export
# step, read by the gates (baseline key residency.mlcomputeplan.<function>)
RESIDENCY_KEY = "ane_residency"
# how reports label Core ML's own logits (gate_inputs.coreml_parity, export.parity.coreml_parity): the other
# figure only a Mac measures at export; this light module is what the checklist imports
COREML_SOURCE = "MLModel.predict"


def ane_residency(package: str | Path, functions: list[str], compute_units: str = "ALL") -> dict[str, Any]:
    """``gate_inputs.ane_residency`` measured by ``MLComputePlan`` for ``functions`` of a saved ``.mlpackage``.

    Returns ``source``, ``compute_units`` and ``functions``: per function, ``residency`` (share of
    the plan's estimated cost preferring the ANE), ``gpu_share`` and ``cpu_share`` (the same for the GPU and
    the CPU) and ``by_op_type`` (per op type: whether every op prefers the ANE, the plan's relative cost, and
    the part of it on the ANE).

    Raises:
        RuntimeError: off macOS (Core ML is not available).
        ValueError: the package is not an ML program or lacks one of ``functions``.
    """
    if sys.platform != "darwin":
        raise RuntimeError(
            f"MLComputePlan needs macOS 14.4+ (Core ML framework); no ANE residency can be measured on {sys.platform}"
        )
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    units = getattr(ct.ComputeUnit, compute_units)
    model = ct.models.MLModel(str(package), compute_units=units, function_name=functions[0])  # compiles the package
    plan = MLComputePlan.load_from_path(model.get_compiled_model_path(), compute_units=model.compute_unit)
    program = plan.model_structure.program
    if program is None:
        raise ValueError(f"{package}: not an ML program")
    missing = [f for f in functions if f not in program.functions]
    if missing:
        raise ValueError(f"{package}: no functions {missing} in the compute plan (has {sorted(program.functions)})")
    return {
        "source": PLAN_SOURCE,
        "compute_units": compute_units,
        "functions": {name: _function_residency(plan, program.functions[name]) for name in functions},
    }


def _function_residency(plan: Any, function: Any) -> dict[str, Any]:
    from coremltools.models.compute_device import MLCPUComputeDevice, MLGPUComputeDevice, MLNeuralEngineComputeDevice

    devices = {"ane": MLNeuralEngineComputeDevice, "gpu": MLGPUComputeDevice, "cpu": MLCPUComputeDevice}
    by_op: dict[str, dict[str, Any]] = {}
    costs = dict.fromkeys(devices, 0.0)
    total_cost = 0.0
    for op in function.block.operations:
        if op.operator_name == "const":
            continue
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        weight = cost.weight if cost is not None else 0.0
        preferred = None if usage is None else usage.preferred_compute_device
        device = next((name for name, kind in devices.items() if isinstance(preferred, kind)), None)
        entry = by_op.setdefault(op.operator_name, {"on_ane": True, "cost": 0.0, "ane_cost": 0.0})
        entry["on_ane"] = entry["on_ane"] and device == "ane"
        entry["cost"] += weight
        entry["ane_cost"] += weight if device == "ane" else 0.0
        total_cost += weight
        if device is not None:
            costs[device] += weight
    shares = {name: cost / total_cost if total_cost else 0.0 for name, cost in costs.items()}
    return {"residency": shares["ane"], "gpu_share": shares["gpu"], "cpu_share": shares["cpu"],
            "by_op_type": dict(sorted(by_op.items()))}
