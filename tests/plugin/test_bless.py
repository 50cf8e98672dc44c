"""--bless: measure and write baselines, then a normal run passes; missing baselines fail loudly."""

from __future__ import annotations

import json

import pytest

from distillgates.model import model_fingerprint
from distillgates.rundir import RunDir

from .conftest import good_item_scores, tiny_student

F1_DRIFT = "gates/test_f1_drift.py"


def test_missing_baseline_fails_and_prints_the_bless_command(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    result = pytester.runpytest(F1_DRIFT, f"--run-dir={run}", f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        f"*missing baseline 'f1_lax_macro' in *baselines/common/f1_drift.json; bless it with: pytest "
        f"'gates/test_f1_drift.py::test_f1_drift[[]lax[]]' --bless --hw-profile={own_profile} --run-dir={run}*",
    ])


def test_bless_then_normal_run_passes(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    args = [F1_DRIFT, f"--run-dir={run}", f"--hw-profile={own_profile}"]
    blessed = pytester.runpytest(*args, "--bless")
    blessed.assert_outcomes(passed=2)
    blessed.stdout.fnmatch_lines(["*blessed baselines written: *baselines/common/f1_drift.json"])
    data = json.loads((pytester.path / "baselines" / "common" / "f1_drift.json").read_text())
    entry = data["entries"]["f1_lax_macro"]
    assert entry["value"] == 118 / 120 and "integration F1 lax" in entry["definition"]
    assert entry["fingerprints"] == json.loads(RunDir(run).report.read_text())["header"]["fingerprints"]  # all six
    assert entry["fingerprints"]["model_fingerprint"] == model_fingerprint(tiny_student())
    provenance = entry["provenance"]
    assert provenance["git_sha"] == "0" * 40 and "fingerprints" not in provenance
    assert provenance["hardware"]["hardware_profile_key"] == own_profile and provenance["date"]
    pytester.runpytest(*args).assert_outcomes(passed=2)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_bless_refuses_a_value_that_is_not_a_finite_number(pytester, gates_project, make_run, own_profile, value):
    gates_project()
    rows = good_item_scores()
    rows[0]["f1_lax"] = value  # the mean over the items is then not finite either
    run = make_run(item_scores=rows)
    result = pytester.runpytest(F1_DRIFT, f"--run-dir={run}", f"--hw-profile={own_profile}", "--bless")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*refusing to bless: f1_drift/f1_lax_macro: f1_lax_macro = {value!r} is not a "
                                 "finite number*"])
    entries = json.loads((pytester.path / "baselines" / "common" / "f1_drift.json").read_text())["entries"]
    assert sorted(entries) == ["f1_strict_macro"]


def test_bless_refuses_a_run_without_fingerprints(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"header.fingerprints.dataset_sha256": None})
    result = pytester.runpytest(F1_DRIFT, f"--run-dir={run}", f"--hw-profile={own_profile}", "--bless")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*refusing to bless: f1_drift/f1_lax_macro: a baseline records the eval set it "
                                 "was measured on: *null or missing fingerprint(s) dataset_sha256*"])
    assert not (pytester.path / "baselines").exists()


def test_bless_reports_unused_baselines(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    args = [f"--run-dir={run}", f"--hw-profile={own_profile}", "--bless"]
    pytester.runpytest(F1_DRIFT, *args).assert_outcomes(passed=2)
    result = pytester.runpytest(F1_DRIFT, *args, "-k", "lax")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*baseline not used by any gate: *common/f1_drift.json::f1_strict_macro"])


def test_bless_still_applies_absolute_thresholds(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"gate_inputs.ane_residency.functions.decode.residency": 0.5})
    result = pytester.runpytest("gates/test_ane_residency.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--bless")
    result.assert_outcomes(passed=7, failed=1)  # the decode residency gate fails; the drop baselines are (re)blessed


def test_interrupted_bless_leaves_old_baselines_intact(pytester, gates_project, make_run, own_profile):
    gates_project()
    args = [F1_DRIFT, f"--hw-profile={own_profile}"]
    pytester.runpytest(*args, f"--run-dir={make_run('old')}", "--bless").assert_outcomes(passed=2)
    path = pytester.path / "baselines" / "common" / "f1_drift.json"
    before = path.read_bytes()
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_runtest_teardown(item):
            if item.name == "test_f1_drift[strict]":
                raise KeyboardInterrupt  # Ctrl-C after a gate was blessed in memory
        """
    )
    result = pytester.runpytest(*args, f"--run-dir={make_run('new', **{'quality.student.f1_lax_macro': 0.5})}",
                                "--bless", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*bless interrupted: no baseline was written, the old baselines are intact*"])
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["f1_drift.json"]  # no temp file left
