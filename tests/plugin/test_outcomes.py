"""Every collected gate test appears in the gate reports with its real outcome (issue #31, item 1)."""

from __future__ import annotations

import json

from .conftest import DELETE


def _report(pytester, name="gates.json"):
    return json.loads((pytester.path / name).read_text())


def test_a_crash_is_an_error_and_the_session_fails(pytester, gates_project, make_run, own_profile):
    """With gate_inputs.export missing, the export gates reading it crash: 7 errors, with the exception line, never a
    pass (the fp16 headroom gate reads gate_inputs.fp16_headroom and passes)."""
    gates_project()
    run = make_run(**{"gate_inputs.export": DELETE})
    result = pytester.runpytest("gates/test_export.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-report=gates.json", "--gate-summary=summary.md")
    result.assert_outcomes(passed=3, failed=7)
    report = _report(pytester)
    assert report["result"] == "fail" and report["summary"] == {"pass": 3, "error": 7}
    assert report["checks"] == {"pass": 3}  # what the report said before: 3 checks, all pass
    errors = [t for t in report["tests"] if t["outcome"] == "error"]
    assert len(errors) == 7 and all(t["failed"] for t in errors)
    assert all("RunArtifactError" in t["reason"] and "missing key 'gate_inputs.export" in t["reason"] for t in errors)
    summary = (pytester.path / "summary.md").read_text()
    assert "**FAIL: 3 pass, 7 error" in summary
    assert "| error | export | `test_contract` | — | — | — | — | — | distillgates.rundir.RunArtifactError:" in summary
    result.stdout.fnmatch_lines(["*error*export*test_contract*", "distillgates gates: FAIL: 3 pass, 7 error*"])


def test_fixture_error_is_an_error(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"quality.student": DELETE})
    pytester.runpytest("gates/test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                       "--gate-report=gates.json").assert_outcomes(errors=2)
    report = _report(pytester)
    assert report["result"] == "fail" and report["summary"] == {"error": 2} and report["gates"] == []
    assert "missing key 'quality.student'" in report["tests"][0]["reason"]


def test_skip_is_not_measured_with_its_reason(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"gate_inputs.teacher.kind": "local"})
    pytester.runpytest("gates/test_determinism.py::test_api_teacher_made_no_retries", f"--run-dir={run}",
                       f"--hw-profile={own_profile}", "--gate-report=gates.json").assert_outcomes(skipped=1)
    report = _report(pytester)
    assert report["result"] == "pass" and report["summary"] == {"not measured": 1}
    assert report["tests"][0]["reason"] == "teacher kind 'local': the HTTP determinism gate applies to API teachers"


def test_deselected_speed_gates_are_listed(pytester, gates_project, make_run, own_profile):
    gates_project()
    pytester.runpytest("gates/test_speed.py", "gates/test_speculative.py", f"--run-dir={make_run()}",
                       f"--hw-profile={own_profile}", "--gate-report=gates.json").assert_outcomes(passed=5)
    report = _report(pytester)
    assert report["result"] == "pass" and report["summary"] == {"pass": 5, "deselected": 4}
    speed = [t for t in report["tests"] if t["outcome"] == "deselected"]
    assert {t["group"] for t in speed} == {"speed"} and "run only when selected" in speed[0]["reason"]


def test_tests_not_run_read_stopped(pytester, gates_project, make_run, own_profile):
    """-x: the tests after the first failure never ran; they are listed, not dropped."""
    gates_project()
    run = make_run(**{"quality.student.privacy_ok_rate": 0.5})
    pytester.runpytest("gates/test_privacy.py", "-x", f"--run-dir={run}", f"--hw-profile={own_profile}",
                       "--gate-report=gates.json").assert_outcomes(failed=1)
    report = _report(pytester)
    assert report["result"] == "fail" and report["summary"] == {"fail": 1, "stopped": 1}
    assert report["tests"][1]["reason"].startswith("not run")
