"""Speed gates and their options: -m speed, --speed-samples, --speed-max-rounds, --speed-paired,
--speed-inconclusive. Samples come from a synthetic measurement (log-normal noise, seeded) so
the gate statistics are what is tested; the real harness is exercised by benchmarks/ and -m speed."""

from __future__ import annotations

import json

from .conftest import project_file

SPEED = "gates/test_speed.py"


def bless(pytester, gates_project, run, profile, *extra):
    gates_project(slowdown=1.0)
    result = pytester.runpytest(SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={profile}", "--bless", *extra)
    result.assert_outcomes(passed=4)
    return json.loads((pytester.path / "baselines" / profile / "speed.json").read_text())


def test_speed_gates_need_explicit_selection(pytester, gates_project, make_run, own_profile):
    gates_project(slowdown=1.0)
    result = pytester.runpytest(SPEED, f"--run-dir={make_run()}", f"--hw-profile={own_profile}")
    result.assert_outcomes(deselected=4)


def test_same_engine_passes_slower_engine_fails(pytester, gates_project, make_run, own_profile):
    run = make_run()
    data = bless(pytester, gates_project, run, own_profile)
    assert sorted(data["entries"]) == ["tps.p50", "tps.p95", "ttft_ms.p50", "ttft_ms.p95"]
    assert len(data["entries"]["ttft_ms.p50"]["samples"]) == 20  # --speed-samples default
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}"]
    gates_project(slowdown=1.0)
    pytester.runpytest(*args).assert_outcomes(passed=4)
    gates_project(slowdown=1.2)  # a 20% slower engine
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*gate speed/ttft_ms.p50 FAILED*significant regression beyond threshold*"])


def test_speed_samples(pytester, gates_project, make_run, own_profile):
    data = bless(pytester, gates_project, make_run(), own_profile, "--speed-samples=7")
    assert all(len(entry["samples"]) == 7 for entry in data["entries"].values())


def test_inconclusive_is_reported_after_the_round_bound(pytester, gates_project, make_run, own_profile):
    run = make_run()
    bless(pytester, gates_project, run, own_profile, "--speed-samples=5")
    gates_project(slowdown=1.1, noise=[0.5, 2.0, 0.7, 1.6, 1.0])  # 10% slower on the median, but spread wide
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}",
            "--speed-samples=5", "--speed-max-rounds=1", "-rs", "-k", "ttft_ms-p50"]
    result = pytester.runpytest(*args)
    result.assert_outcomes(skipped=1, deselected=3)
    result.stdout.fnmatch_lines(["*INCONCLUSIVE*after 2 round(s) of 5 samples (bound of 1 extra rounds reached)*"])
    pytester.runpytest(*args, "--speed-inconclusive=fail").assert_outcomes(failed=1, deselected=3)


def test_paired_mode_measures_reference_interleaved(pytester, gates_project, make_run, own_profile):
    run = make_run()
    bless(pytester, gates_project, run, own_profile)
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}", "--speed-paired",
            "--gate-report=report.json"]
    gates_project(slowdown=1.2)
    pytester.runpytest(*args).assert_outcomes(failed=4)
    gates = json.loads((pytester.path / "report.json").read_text())["gates"]
    speed = [g for g in gates if g["comparison"] == "speed_no_regression"]
    assert len(speed) == 4 and all(g["details"]["paired"] for g in speed)
    assert all(len(g["details"]["reference_samples"]) == len(g["details"]["candidate_samples"]) for g in speed)
    gates_project(slowdown=1.0)
    pytester.runpytest(*args).assert_outcomes(passed=4)


def _profile_yaml(key: str, max_regression: float, min_samples: int) -> str:
    return f"""version: 1
profiles:
  - key: {key}
    soc_regex: '.*'
    min_ram_gb: 1
    gating: {{max_regression: {max_regression}, min_samples: {min_samples}}}
"""


def test_the_profile_gating_policy_sets_threshold_and_min_samples(pytester, gates_project, make_run, own_profile):
    """The project's hardware profiles: the selected profile's gating.max_regression is the threshold and
    gating.min_samples the least samples per round (a 20% slowdown fails at 5%, passes at 30%)."""
    run, key = make_run(), "test-box"  # the project's profiles file: this machine is a "test-box"
    profiles = project_file(pytester.path, "hardware_profiles", "configs/hardware_profiles.yaml",
                            _profile_yaml(key, 0.30, 30))
    data = bless(pytester, gates_project, run, key, "--speed-samples=7")
    assert len(data["entries"]["ttft_ms.p50"]["samples"]) == 30  # raised to the profile's min_samples
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={key}"]
    gates_project(slowdown=1.2)
    pytester.runpytest(*args).assert_outcomes(passed=4)
    profiles.write_text(_profile_yaml(key, 0.05, 30))
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*gate speed/ttft_ms.p50 FAILED*threshold 0.05*"])
