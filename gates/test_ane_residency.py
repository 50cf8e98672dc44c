"""ANE residency gates: share of estimated work on the ANE, and no drop vs the baseline."""

from __future__ import annotations

import pytest


def _definition(source: str) -> str:
    label = "MLComputePlan (macOS)" if source == "mlcomputeplan" else "static MIL estimate (not measured on device)"
    return f"share of estimated work (FLOPs) on the ANE, source: {label}"


@pytest.mark.ane_residency
def test_ane_share(gate, report, thresholds):
    ane = report.get("gate_inputs.ane")
    gate.at_least(f"ane.estimated_share[{ane['source']}]", ane["estimated_share"], thresholds.ane_residency_min,
                  _definition(ane["source"]))


@pytest.mark.ane_residency
def test_ane_no_drop(gate, report, thresholds):
    ane = report.get("gate_inputs.ane")
    # A compute plan depends on the device; the static estimate does not.
    gate.no_regression(f"ane.estimated_share[{ane['source']}]", ane["estimated_share"],
                       f"estimated_share.{ane['source']}", tolerance=thresholds.ane_residency_drop_max,
                       higher_is_better=True, definition=_definition(ane["source"]),
                       hardware_dependent=ane["source"] == "mlcomputeplan")
