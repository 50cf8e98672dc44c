"""ANE residency gates (macOS): the share of work ``MLComputePlan`` places on the ANE, per function of the
multifunction package (``prefill_<L>`` for each enumerated shape, and ``decode``, where most generated
tokens run), and no drop vs the baseline of this hardware profile.

Residency is measured only by the compute plan, which the export step records on macOS
(``gate_inputs.ane_residency.functions.<function>``). Off macOS there is no such figure and the gates
skip, saying so; the static op-eligibility lint is gated by the ``export`` gates and is not residency.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from distillgates.export.compute_plan import PLAN_SOURCE, RESIDENCY_KEY

DEFINITION = ("share of the {function} function's compute-plan estimated cost whose preferred device is the Neural "
              "Engine, measured by MLComputePlan when the run was exported (None: exported off macOS, or the function "
              "was not measured; re-run `distillgates step export` on this Mac)")


@pytest.fixture
def figure(report) -> dict[str, Any] | None:
    """The package's compute-plan figures (every function), once the package is the exported one."""
    measured = report.get("gate_inputs").get(RESIDENCY_KEY)
    if measured is None and sys.platform != "darwin":
        pytest.skip(f"ANE residency is measured only by MLComputePlan (macOS 14.4+); this run was exported on "
                    f"{report.header.get('hardware', {}).get('os')} and has no residency figure")
    report.run.verify_packages()  # figures of the packages in export/ only: else an error naming each package
    return measured


def residency(gate, report, figure, function: str) -> float | None:
    """The function's residency, once the figure is known to be this session's hardware profile's."""
    gate.measured_on("ane.hardware_profile_key", report.measured_on(figure), f"ANE residency ({function})")
    entry = (figure or {}).get("functions", {}).get(function)
    return None if entry is None else entry["residency"]


def _name(function: str) -> str:
    return f"ane.residency[{PLAN_SOURCE}].{function}"


@pytest.mark.ane_residency
def test_ane_residency(gate, report, figure, export_function, thresholds):
    gate.at_least(_name(export_function), residency(gate, report, figure, export_function),
                  thresholds.ane_residency_min, DEFINITION.format(function=export_function))


@pytest.mark.ane_residency
def test_ane_residency_no_drop(gate, report, figure, export_function, thresholds):
    # a compute plan depends on the OS and the chip: baselines are per hardware profile
    gate.no_regression(_name(export_function), residency(gate, report, figure, export_function),
                       f"residency.mlcomputeplan.{export_function}", tolerance=thresholds.ane_residency_drop_max,
                       higher_is_better=True, definition=DEFINITION.format(function=export_function),
                       hardware_dependent=True)
