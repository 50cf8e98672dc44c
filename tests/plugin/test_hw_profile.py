"""--hw-profile: select the profile; a measurement on other hardware is refused for hardware gates."""

from __future__ import annotations

import json

import pytest

from .conftest import DELETE

ANE = "gates/test_ane_residency.py"  # the good run carries an MLComputePlan residency, which depends on the device


def other_profile(own: str) -> str:
    return "m1-max-64g" if own != "m1-max-64g" else "m3-max-48g"


def test_default_is_the_detected_profile(pytester, gates_project, make_run, own_profile):
    gates_project()
    result = pytester.runpytest(ANE, f"--run-dir={make_run()}", "--bless")
    result.assert_outcomes(passed=8)  # per function: prefill_128/192/256, decode
    data = json.loads((pytester.path / "baselines" / own_profile / "ane_residency.json").read_text())
    assert data["hardware_profile_key"] == own_profile
    functions = ("prefill_128", "prefill_192", "prefill_256", "decode")
    assert set(data["entries"]) == {f"residency.mlcomputeplan.{f}" for f in functions}


def test_selected_profile_that_is_not_this_machine_is_refused(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    other = other_profile(own_profile)
    pytester.runpytest(ANE, f"--run-dir={run}", f"--hw-profile={other}", "--bless", "--allow-cross-hw")
    result = pytester.runpytest(ANE, f"--run-dir={run}", f"--hw-profile={other}")
    result.assert_outcomes(failed=8)  # the figures were measured here, not on the selected profile's machine
    result.stdout.fnmatch_lines([f"*measured on hardware profile '{own_profile}', this session gates hardware "
                                 f"profile '{other}'*--allow-cross-hw*"])
    # allowed across hardware: the absolute gates pass, the drop gates compare with the other profile's baselines
    result = pytester.runpytest(ANE, f"--run-dir={run}", f"--hw-profile={other}", "--allow-cross-hw")
    result.assert_outcomes(passed=8)


def test_hardware_free_gates_ignore_the_profile(pytester, gates_project, make_run, own_profile):
    gates_project()
    result = pytester.runpytest("gates/test_privacy.py", f"--run-dir={make_run()}",
                                f"--hw-profile={other_profile(own_profile)}")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("key", ["M1 Max", "-dash-first", "a/b"])
def test_invalid_key_is_a_usage_error(pytester, key):
    result = pytester.runpytest(f"--hw-profile={key}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*invalid hardware profile key*"])


def test_bless_under_another_machines_profile_is_refused(pytester, gates_project, make_run, own_profile):
    """--bless must not write this machine's numbers under another machine's profile."""
    gates_project()
    other = other_profile(own_profile)
    result = pytester.runpytest(ANE, f"--run-dir={make_run()}", f"--hw-profile={other}", "--bless")
    result.assert_outcomes(failed=8)
    result.stdout.fnmatch_lines([f"*measured on hardware profile '{own_profile}', this session gates*'{other}'*"])
    assert not (pytester.path / "baselines" / other).exists()
    # figures of the selected profile's machine, blessed on this one: still refused
    run = make_run("other", **{"gate_inputs.ane_residency.hardware_profile_key": other})
    result = pytester.runpytest(ANE, f"--run-dir={run}", f"--hw-profile={other}", "--bless")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines(["*refusing to bless*does not match this machine*"])
    assert not (pytester.path / "baselines" / other).exists()


@pytest.mark.parametrize("recorded", ["figure", "header"])
def test_core_ml_figures_of_another_machine_are_refused(pytester, gates_project, make_run, own_profile, recorded):
    """A run exported (parity, residency measured) on one Mac is not gated under another profile: each figure's
    own hardware_profile_key, else the report header's, must be the session's."""
    gates_project()
    other = other_profile(own_profile)
    keys = ("ane_residency", "coreml_parity")
    changes = ({f"gate_inputs.{k}.hardware_profile_key": other for k in keys} if recorded == "figure" else
               {**{f"gate_inputs.{k}.hardware_profile_key": DELETE for k in keys},
                "header.hardware.hardware_profile_key": other})
    result = pytester.runpytest(ANE, "gates/test_coreml_parity.py", "-k", "not no_drop",
                                f"--run-dir={make_run(**changes)}", f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=8, deselected=4)  # 4 residency (3 prefills, decode), 3 shapes + decode parity
    result.stdout.fnmatch_lines([f"*Core ML parity was measured on hardware profile '{other}', this session gates "
                                 f"hardware profile '{own_profile}'*"])
