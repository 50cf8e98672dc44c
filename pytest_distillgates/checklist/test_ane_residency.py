"""ANE residency gates (macOS): the share of work ``MLComputePlan`` places on the ANE, and no drop vs
the baseline of this hardware profile.

Residency is measured only by the compute plan, which the export step records on macOS
(``gate_inputs.ane_residency``). Off macOS there is no such figure and the gates skip, saying so;
the static op-eligibility lint is gated by the ``export`` gates and is not residency.
"""

from __future__ import annotations

import sys

import pytest

from distillgates.export.compute_plan import PLAN_SOURCE

NAME = f"ane.residency[{PLAN_SOURCE}]"
DEFINITION = ("share of the compute plan's estimated cost whose preferred device is the Neural Engine, measured "
              "by MLComputePlan when the run was exported (None: exported off macOS; re-run `distillgates step "
              "export` on this Mac)")


@pytest.fixture
def residency(report) -> float | None:
    measured = report.get("gate_inputs").get("ane_residency")
    if measured is None and sys.platform != "darwin":
        pytest.skip(f"ANE residency is measured only by MLComputePlan (macOS 14.4+); this run was exported on "
                    f"{report.header.get('hardware', {}).get('os')} and has no residency figure")
    return None if measured is None else measured["residency"]


@pytest.mark.ane_residency
def test_ane_residency(gate, residency, thresholds):
    gate.at_least(NAME, residency, thresholds.ane_residency_min, DEFINITION)


@pytest.mark.ane_residency
def test_ane_residency_no_drop(gate, residency, thresholds):
    # a compute plan depends on the OS and the chip: baselines are per hardware profile
    gate.no_regression(NAME, residency, "residency.mlcomputeplan", tolerance=thresholds.ane_residency_drop_max,
                       higher_is_better=True, definition=DEFINITION, hardware_dependent=True)
