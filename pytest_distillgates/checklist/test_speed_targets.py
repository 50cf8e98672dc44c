"""Absolute speed gates: the hardware profile's ``speed_targets`` bands, and no memory pressure.

The relative speed gates (``-m speed``) pass a student that was already slow when it was blessed. These gates
read the run's speed report (timed by the pipeline's speed step in a speed worker process of its own) and check
it against the bands of the session's hardware profile (``speed_targets`` in the hardware profiles; they belong to
a model and a chip, so a project sets its own): TTFT p50/p95 at most, TPS p50/p5 at least, per enumerated shape
(the report's ``per_shape``) and the worker's peak memory. A profile without bands (every generated profile, the
embedded ones) skips them, saying so. The memory-pressure gate runs everywhere: the worker's peak resident memory
at most ``peak_memory_fraction_max`` of the measuring machine's RAM.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from distillgates.hardware import SpeedTargets, load_profiles

# (gated figure, target field, at_most): the report's percentile, or the 5th percentile of its raw samples
FIGURES = [("ttft_ms.p50", "ttft_ms_p50_max", True), ("ttft_ms.p95", "ttft_ms_p95_max", True),
           ("tps.p50", "tps_p50_min", False), ("tps.p5", "tps_p5_min", False)]


@pytest.fixture
def speed(report) -> dict[str, Any]:
    return report.get("speed")


@pytest.fixture
def targets(gate_session, hardware_profile) -> SpeedTargets:
    """The session's profile's bands (the gates check first that the speed report is this profile's)."""
    path = gate_session.project.hardware_profiles_path
    profile = next((p for p in load_profiles(path) if p.key == hardware_profile), None)
    if profile is None or profile.speed_targets is None:
        pytest.skip(f"hardware profile {hardware_profile!r} has no speed_targets in {path}: no absolute speed bands "
                    "on this machine (the relative speed gates still apply)")
    return profile.speed_targets


def _figure(figures: dict[str, Any], name: str) -> float | None:
    metric, stat = name.split(".")
    if stat == "p5":
        samples = figures.get(metric, {}).get("samples") or []
        return statistics.quantiles(samples, n=20, method="inclusive")[0] if len(samples) > 1 else None
    return figures.get(metric, {}).get(stat)


def _check(gate, speed, name: str, value: float | None, bound: float | None, at_most: bool, definition: str) -> None:
    if bound is None:
        pytest.skip(f"no {name} band in the profile's speed_targets")
    gate.measured_on("speed.hardware_profile_key", speed.get("hardware_profile_key"), "the speed report")
    (gate.at_most if at_most else gate.at_least)(name, value, bound, definition)


@pytest.mark.speed_targets
@pytest.mark.parametrize(("figure", "field", "at_most"), FIGURES, ids=[f for f, _, _ in FIGURES])
def test_speed_target(gate, speed, targets, figure, field, at_most):
    _check(gate, speed, f"speed_targets.{figure}", _figure(speed, figure), getattr(targets, field), at_most,
           f"{figure} of the speed report (batch 1, {speed.get('backend')}; {speed.get('n_prompts')} prompts x "
           f"{speed.get('repeats')} repeats) vs the profile's band")


@pytest.mark.speed_targets
@pytest.mark.parametrize(("figure", "field", "at_most"), [FIGURES[0], FIGURES[2]], ids=["ttft_ms.p50", "tps.p50"])
def test_speed_target_per_shape(gate, speed, targets, shape, figure, field, at_most):
    target = next((t for t in targets.shapes if str(t.length) == shape), None)
    if target is None:
        pytest.skip(f"no speed_targets.shapes entry for length {shape}")
    measured = (speed.get("per_shape") or {}).get(shape)  # None (not timed per shape) fails the band
    value = None if measured is None else _figure(measured, figure)
    _check(gate, speed, f"speed_targets.shape[{shape}].{figure}", value, getattr(target, field), at_most,
           f"{figure} with a prompt that takes prefill shape {shape} (the speed report's per_shape)")


@pytest.mark.speed_targets
def test_peak_memory_target(gate, speed, targets):
    peak = speed.get("peak_memory_bytes")
    _check(gate, speed, "speed_targets.peak_memory_gb", None if peak is None else peak / 2**30,
           targets.peak_memory_gb_max, True,
           "peak resident memory of the speed worker process (model, tokenizer, engine), GiB")


@pytest.mark.speed_targets
def test_no_memory_pressure(gate, report, speed, thresholds):
    peak, ram = speed.get("peak_memory_bytes"), report.header.get("hardware", {}).get("ram_gb")
    gate.at_most("speed.peak_memory_ram_share", None if peak is None or not ram else peak / (ram * 2**30),
                 thresholds.peak_memory_fraction_max,
                 f"peak resident memory of the speed worker process / the measuring machine's RAM ({ram} GB)")


@pytest.mark.speed_targets
def test_drafter_ttft_target(gate, report, speed, targets):
    if targets.drafter_ttft_ms_p50_max is None:
        pytest.skip("no speed_targets.drafter_ttft_ms_p50_max band in the profile")
    processes = (report.get("gate_inputs").get("speculative") or {}).get("ttft_drafter") or []
    samples = [s for process in processes for s in process]
    _check(gate, speed, "speed_targets.drafter_ttft_ms.p50", statistics.median(samples) if samples else None,
           targets.drafter_ttft_ms_p50_max, True,
           "TTFT p50 of the drafter decoding alone, in the speculative speed worker processes (None: no drafter)")
