"""speed_targets gates: the hardware profile's absolute bands (whole prompt, per shape, peak memory) and no memory
pressure, each failing when the run's speed report violates it."""

from __future__ import annotations

import pytest

from .conftest import DELETE, project_file

GATES = "gates/test_speed_targets.py"
TARGETS = """
version: 1
profiles:
  - key: ci-box
    soc_regex: '.*'
    min_ram_gb: 0.5
{targets}"""
BANDS = """    speed_targets:
      ttft_ms_p50_max: 20
      ttft_ms_p95_max: 20
      tps_p50_min: 50
      tps_p5_min: 95
      peak_memory_gb_max: 1
      drafter_ttft_ms_p50_max: 5
      shapes:
        - {length: 256, ttft_ms_p50_max: 20, tps_p50_min: 50}
"""


@pytest.fixture
def project(pytester, gates_project):
    def make(targets: str = BANDS) -> None:
        gates_project()
        project_file(pytester.path, "hardware_profiles", "profiles.yaml", TARGETS.format(targets=targets))

    return make


def run(pytester, make_run, **changes):
    return pytester.runpytest(GATES, f"--run-dir={make_run(**{'speed.hardware_profile_key': 'ci-box', **changes})}",
                              "-rs")


def test_a_run_within_the_bands_passes(pytester, project, make_run):
    project()
    result = run(pytester, make_run)
    # 4 whole-prompt bands, 2 at shape 256 (128 and 192 have none: skipped), peak memory, drafter TTFT, memory
    # pressure
    result.assert_outcomes(passed=9, skipped=4)
    result.stdout.fnmatch_lines(["*no speed_targets.shapes entry for length 128*"])


@pytest.mark.parametrize(("changes", "failed", "message"), [
    ({"speed.ttft_ms.p50": 25.0}, 1, "speed_targets.ttft_ms.p50 = 25 violates <= 20"),
    # one slow sample of four: TPS p5 falls under its band, the median stays
    ({"speed.tps.samples": [100.0, 110.0, 120.0, 20.0]}, 1, "speed_targets.tps.p5 = * violates >= 95"),
    ({"speed.per_shape.256.tps.p50": 30.0}, 1, "speed_targets.shape[[]256[]].tps.p50 = 30 violates >= 50"),
    ({"speed.per_shape": DELETE}, 2, "speed_targets.shape[[]256[]].ttft_ms.p50 = None violates <= 20"),
    # 7 GiB of the header's 8 GB: over the 1 GiB band and past 0.75 of the RAM
    ({"speed.peak_memory_bytes": 7 * 2**30}, 2, "speed.peak_memory_ram_share = 0.875 violates <= 0.75"),
    ({"gate_inputs.speculative.ttft_drafter": [[6.0] * 8] * 3}, 1,
     "speed_targets.drafter_ttft_ms.p50 = 6 violates <= 5"),
])
def test_a_violated_band_fails(pytester, project, make_run, changes, failed, message):
    project()
    result = run(pytester, make_run, **changes)
    assert result.parseoutcomes()["failed"] == failed
    result.stdout.fnmatch_lines([f"*{message}*"])


def test_a_profile_without_bands_skips_them_but_gates_memory_pressure(pytester, project, make_run):
    project(targets="")
    result = run(pytester, make_run, **{"speed.peak_memory_bytes": 7 * 2**30})
    result.assert_outcomes(failed=1, skipped=12)
    result.stdout.fnmatch_lines(["*hardware profile 'ci-box' has no speed_targets in *profiles.yaml*"])


def test_a_speed_report_of_another_profile_fails_the_bands(pytester, project, make_run):
    project()
    result = pytester.runpytest(GATES, f"--run-dir={make_run(**{'speed.hardware_profile_key': 'm1-max-64g'})}")
    result.stdout.fnmatch_lines(["*the speed report was measured on hardware profile 'm1-max-64g', this session "
                                 "gates hardware profile 'ci-box'*"])
    assert result.parseoutcomes()["failed"] >= 8
