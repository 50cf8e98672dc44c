"""--gate-report: a JSON report of every gate check, written at session end."""

from __future__ import annotations

import json
import shutil

from distillgates.project import EMBEDDED_THRESHOLDS
from pytest_distillgates.checklist import CHECKLIST_DIR

from .conftest import project_file

DEFAULTS = str(EMBEDDED_THRESHOLDS)
LOOSER = "; LOOSER than the embedded defaults: privacy_ok_rate_min 0.99 (embedded 1.0)"  # 0.99 < 1.0


def test_json_report_lists_every_check(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"quality.student.privacy_ok_rate": 0.99})
    result = pytester.runpytest("gates/test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-report=out/gates.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*gate report written: out/gates.json"])
    report = json.loads((pytester.path / "out" / "gates.json").read_text())
    assert report["summary"] == {"fail": 1, "pass": 1}
    assert report["session"]["hardware_profile_key"] == own_profile and report["session"]["run_dir"] == str(run)
    assert report["session"]["thresholds_source"] == DEFAULTS  # the pytester project names no thresholds file
    failed = next(g for g in report["gates"] if g["verdict"] == "fail")
    assert failed["name"] == "privacy_ok_rate" and failed["measured"] == 0.99 and failed["threshold"] == 1.0
    assert failed["group"] == "privacy" and failed["nodeid"] == "gates/test_privacy.py::test_privacy_ok_rate"
    assert "violates >= 1" in failed["reason"]
    # 360 items, all privacy-ok in the fabricated per-item outcomes: the Wilson interval of 360/360
    assert failed["n"] == 360 and failed["ci"][1] == 1.0 and 0.989 < failed["ci"][0] < 0.99


def test_report_names_the_file_of_each_threshold(pytester, gates_project, make_run, own_profile):
    """The project's thresholds file overrides the keys it sets; every other threshold stays embedded."""
    gates_project()
    own = project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  privacy_ok_rate_min: 0.99\n")
    run = make_run(**{"quality.student.privacy_ok_rate": 0.99})
    result = pytester.runpytest("gates/test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-report=gates.json")
    result.assert_outcomes(passed=2)
    session = json.loads((pytester.path / "gates.json").read_text())["session"]
    assert session["thresholds_source"] == f"{own} (privacy_ok_rate_min); the rest: {DEFAULTS}{LOOSER}"
    assert session["threshold_sources"]["privacy_ok_rate_min"] == str(own)
    assert session["threshold_sources"]["controls_with_integration_max"] == DEFAULTS
    result.stdout.fnmatch_lines(["*thresholds:*", "*(privacy_ok_rate_min); the rest: *"])  # the table's caption


def test_project_settings_are_found_above_pytests_rootdir(pytester, make_run, own_profile, monkeypatch):
    """`pytest` in the tests/ folder of a project with no pytest ini-file: pytest's rootdir is tests/, and the
    project's settings (distillgates.yaml in the folder above) still apply, never silently the embedded ones."""
    tests = pytester.path / "tests"
    tests.mkdir()
    shutil.copy(CHECKLIST_DIR / "test_privacy.py", tests / "test_privacy.py")
    own = project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  privacy_ok_rate_min: 0.99\n")
    run = make_run(**{"quality.student.privacy_ok_rate": 0.99})
    report = pytester.path / "gates.json"
    monkeypatch.chdir(tests)
    result = pytester.runpytest("test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                f"--gate-report={report}", "-p", "no:cacheprovider", "--import-mode=importlib")
    result.stdout.fnmatch_lines([f"rootdir: {tests}"])
    result.assert_outcomes(passed=2)
    session = json.loads(report.read_text())["session"]
    assert session["thresholds_source"] == f"{own} (privacy_ok_rate_min); the rest: {DEFAULTS}{LOOSER}"


def test_thresholds_file_without_a_gates_section_is_an_error(pytester, gates_project, make_run, own_profile):
    """Never silently the defaults: a gates.yaml whose thresholds are not under `gates:` is refused."""
    gates_project()
    project_file(pytester.path, "thresholds", "configs/gates.yaml", "privacy_ok_rate_min: 0.99\n")
    result = pytester.runpytest("gates/test_privacy.py", f"--run-dir={make_run()}", f"--hw-profile={own_profile}")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*configs/gates.yaml: no 'gates:' section (the gate thresholds)*"])


def test_report_is_written_even_when_no_gate_ran(pytester, gates_project, own_profile):
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    pytester.runpytest("test_plain.py", "--gate-report=r.json").assert_outcomes(passed=1)
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["gates"] == [] and report["summary"] == {} and report["session"]["thresholds_source"] is None


def test_junit_properties_carry_the_numbers(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"quality.student.controls_with_integration": 2})
    pytester.runpytest("gates/test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                       "--junitxml=junit.xml")
    xml = (pytester.path / "junit.xml").read_text()
    for needle in ('name="controls_with_integration.measured" value="2"',
                   'name="controls_with_integration.threshold" value="0"',
                   'name="controls_with_integration.verdict" value="fail"',
                   "gate privacy/controls_with_integration FAILED: measured 2 &lt;= threshold 0"):
        assert needle in xml, needle
