"""--allow-cross-hw: a baseline blessed on another hardware profile is refused unless allowed."""

from __future__ import annotations

from .test_hw_profile import ANE, other_profile


def bless_on_other_profile(pytester, run, own_profile) -> str:
    other = other_profile(own_profile)
    pytester.runpytest(ANE, f"--run-dir={run}", f"--hw-profile={other}", "--bless",
                       "--allow-cross-hw").assert_outcomes(passed=8)
    assert (pytester.path / "baselines" / other / "ane_residency.json").is_file()
    return other


def test_cross_hardware_baseline_is_refused(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    other = bless_on_other_profile(pytester, run, own_profile)
    result = pytester.runpytest(ANE, f"--run-dir={run}")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines([f"*no baseline ane_residency/* for hardware profile '{own_profile}' "
                                 f"(only for: {other}); refusing a cross-hardware comparison*"])


def test_allow_cross_hw_accepts_it(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    bless_on_other_profile(pytester, run, own_profile)
    pytester.runpytest(ANE, f"--run-dir={run}", "--allow-cross-hw").assert_outcomes(passed=8)
    worse = make_run("worse", **{"gate_inputs.ane_residency.functions.decode.residency": 0.81})
    pytester.runpytest(ANE, f"--run-dir={worse}", "--allow-cross-hw").assert_outcomes(passed=7, failed=1)
