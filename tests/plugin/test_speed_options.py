"""Speed gates and their options: -m speed, --speed-mode, --speed-samples, --speed-workers, --speed-max-rounds,
--speed-inconclusive. The arms are synthetic (log-normal noise, seeded; tests/plugin/conftest.py) so the gate
statistics and the plugin wiring are what is tested; the real workers are exercised by test_speed_live.py,
and the gates' power on the real path by benchmarks/bench_speed_gate_power.py."""

from __future__ import annotations

import json

from distillgates.gates.session import CI_VARIABLES

from .conftest import project_file

SPEED = "gates/test_speed.py"
GATE_KEYS = ["tps.p5", "tps.p50", "ttft_ms.p50", "ttft_ms.p95"]


def bless(pytester, gates_project, run, profile, *extra):
    gates_project(slowdown=1.0)
    result = pytester.runpytest(SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={profile}", "--bless", *extra)
    result.assert_outcomes(passed=4)
    return json.loads((pytester.path / "baselines" / profile / "speed.json").read_text())


def test_speed_gates_need_explicit_selection(pytester, gates_project, make_run, own_profile):
    gates_project(slowdown=1.0)
    result = pytester.runpytest(SPEED, f"--run-dir={make_run()}", f"--hw-profile={own_profile}")
    result.assert_outcomes(deselected=4)


def test_a_a_passes_and_a_slower_engine_fails_in_the_default_ab_mode(pytester, gates_project, make_run, own_profile):
    run = make_run()
    data = bless(pytester, gates_project, run, own_profile)
    assert sorted(data["entries"]) == GATE_KEYS
    entry = data["entries"]["ttft_ms.p50"]
    assert entry["provenance"]["speed_reference"] == {"code": {"commit": "synthetic"}, "artifacts": {}}
    assert [len(group) for group in entry["samples"]] == [24] * 6 * 4  # defaults: 6 processes x 24, every look
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}", "--gate-report=report.json"]
    gates_project(slowdown=1.0)
    pytester.runpytest(*args).assert_outcomes(passed=4)
    gates_project(slowdown=1.2)  # a 20% slower engine
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*gate speed/ttft_ms.p50 FAILED*ab mode: significant regression beyond threshold*"])
    gates = json.loads((pytester.path / "report.json").read_text())["gates"]
    assert {g["details"]["mode"] for g in gates} == {"ab"}
    assert all(len(g["details"]["reference_samples"]) == len(g["details"]["candidate_samples"]) for g in gates)


def test_a_regression_only_in_the_tail_fails_the_p95_gate(pytester, gates_project, make_run, own_profile):
    run = make_run()
    bless(pytester, gates_project, run, own_profile)
    gates_project(slowdown=1.0, tail=1.5)  # every 10th request 50% slower: the median does not move
    result = pytester.runpytest(SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*gate speed/ttft_ms.p95 FAILED*q0.95 slowdown*"])


def test_speed_samples_and_workers(pytester, gates_project, make_run, own_profile):
    data = bless(pytester, gates_project, make_run(), own_profile, "--speed-samples=16", "--speed-workers=3",
                 "--speed-max-rounds=1")
    assert all([len(g) for g in entry["samples"]] == [16] * 6 for entry in data["entries"].values())


def test_inconclusive_skips_locally_and_fails_under_ci(pytester, gates_project, make_run, own_profile, monkeypatch):
    run = make_run()
    bless(pytester, gates_project, run, own_profile, "--speed-samples=16")
    # candidate processes alternately 10% faster and 50% slower: +16%, too spread over 4 pairs to be significant
    gates_project(slowdown=1.0, processes=(0.9, 1.5))
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}", "--speed-samples=16",
            "--speed-workers=2", "--speed-max-rounds=1", "-rs", "-k", "ttft_ms-p50"]
    for name in CI_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    result = pytester.runpytest(*args)
    result.assert_outcomes(skipped=1, deselected=3)
    result.stdout.fnmatch_lines(["*INCONCLUSIVE*not significant*look 2 of at most 2*the bound of rounds is reached*"])
    pytester.runpytest(*args, "--speed-inconclusive=fail").assert_outcomes(failed=1, deselected=3)
    monkeypatch.setenv("CI", "true")
    pytester.runpytest(*args).assert_outcomes(failed=1, deselected=3)
    pytester.runpytest(*args, "--speed-inconclusive=skip").assert_outcomes(skipped=1, deselected=3)
    monkeypatch.setenv("CI", "false")  # only a true value is CI
    pytester.runpytest(*args).assert_outcomes(skipped=1, deselected=3)


def test_stored_mode_compares_with_the_blessed_samples(pytester, gates_project, make_run, own_profile):
    run = make_run()
    bless(pytester, gates_project, run, own_profile)
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}", "--speed-mode=stored",
            "--gate-report=report.json"]
    gates_project(slowdown=1.2)
    pytester.runpytest(*args).assert_outcomes(failed=4)
    gates = json.loads((pytester.path / "report.json").read_text())["gates"]
    assert {g["details"]["mode"] for g in gates} == {"stored"}
    assert all(len(g["details"]["reference_samples"]) == 24 * 6 * 4 for g in gates)  # the blessed samples
    gates_project(slowdown=1.0)
    pytester.runpytest(*args).assert_outcomes(passed=4)


def test_a_baseline_without_a_reference_fails_in_ab_mode_with_the_rebless_command(pytester, gates_project, make_run,
                                                                                  own_profile):
    run = make_run()
    data = bless(pytester, gates_project, run, own_profile)
    for entry in data["entries"].values():
        del entry["provenance"]["speed_reference"]  # blessed before interleaved A/B
    (pytester.path / "baselines" / own_profile / "speed.json").write_text(json.dumps(data))
    result = pytester.runpytest(SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines([f"*no re-runnable reference*re-bless: pytest gates/test_speed.py --bless "
                                 f"--hw-profile={own_profile}*-m speed*"])


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
    gating.min_samples the least samples per worker process (a 20% slowdown fails at 5%, passes at 30%)."""
    run, key = make_run(), "test-box"  # the project's profiles file: this machine is a "test-box"
    profiles = project_file(pytester.path, "hardware_profiles", "configs/hardware_profiles.yaml",
                            _profile_yaml(key, 0.30, 30))
    data = bless(pytester, gates_project, run, key, "--speed-samples=16", "--speed-max-rounds=0")
    assert [len(g) for g in data["entries"]["ttft_ms.p50"]["samples"]] == [30] * 6  # the profile's min_samples
    args = [SPEED, "-m", "speed", f"--run-dir={run}", f"--hw-profile={key}"]
    gates_project(slowdown=1.2)
    pytester.runpytest(*args).assert_outcomes(passed=4)
    profiles.write_text(_profile_yaml(key, 0.05, 30))
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*gate speed/ttft_ms.p50 FAILED*threshold 0.05*"])
