"""ANE residency gates (macOS): the share of work ``MLComputePlan`` places on the ANE, per package
(prefill, and decode, where most generated tokens run), and no drop vs the baseline of this hardware
profile.

Residency is measured only by the compute plan, which the export step records on macOS
(``gate_inputs.ane_residency`` for the prefill package, ``gate_inputs.ane_residency_decode`` for the
decode one). Off macOS there is no such figure and the gates skip, saying so; the static
op-eligibility lint is gated by the ``export`` gates and is not residency.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from distillgates.export.compute_plan import PLAN_SOURCE, RESIDENCY_KEYS

NAME = f"ane.residency[{PLAN_SOURCE}]"
# package -> (check name, baseline key); the prefill names predate the decode gates
PACKAGES = {"prefill": (NAME, "residency.mlcomputeplan"),
            "decode": (f"{NAME}.decode", "residency.mlcomputeplan.decode")}
DEFINITION = ("share of the {package} package's compute-plan estimated cost whose preferred device is the Neural "
              "Engine, measured by MLComputePlan when the run was exported (None: exported off macOS; re-run "
              "`distillgates step export` on this Mac)")


@pytest.fixture(params=list(PACKAGES))
def package(request) -> str:
    return request.param


@pytest.fixture
def figure(report, package) -> dict[str, Any] | None:
    measured = report.get("gate_inputs").get(RESIDENCY_KEYS[package])
    if measured is None and sys.platform != "darwin":
        pytest.skip(f"ANE residency is measured only by MLComputePlan (macOS 14.4+); this run was exported on "
                    f"{report.header.get('hardware', {}).get('os')} and has no residency figure")
    report.run.verify_packages()  # figures of the packages in export/ only: else an error naming each package
    return measured


def residency(gate, report, figure, package) -> float | None:
    """The package's residency, once it is known to be this session's hardware profile's."""
    gate.measured_on("ane.hardware_profile_key", report.measured_on(figure), f"ANE residency ({package})")
    return None if figure is None else figure["residency"]


@pytest.mark.ane_residency
def test_ane_residency(gate, report, figure, package, thresholds):
    gate.at_least(PACKAGES[package][0], residency(gate, report, figure, package), thresholds.ane_residency_min,
                  DEFINITION.format(package=package))


@pytest.mark.ane_residency
def test_ane_residency_no_drop(gate, report, figure, package, thresholds):
    # a compute plan depends on the OS and the chip: baselines are per hardware profile
    name, key = PACKAGES[package]
    gate.no_regression(name, residency(gate, report, figure, package), key,
                       tolerance=thresholds.ane_residency_drop_max, higher_is_better=True,
                       definition=DEFINITION.format(package=package), hardware_dependent=True)
