"""No gate passes on an empty slice (issue #31, item 4): "not measured (0 items)", failing under CI unless waived."""

from __future__ import annotations

import json

import pytest

from .conftest import project_file

SLICES = [("items_with_pii", "test_privacy.py::test_privacy_ok_rate", "privacy_ok_rate"),
          ("control_items", "test_privacy.py::test_controls_with_integration", "controls_with_integration"),
          ("tool_absent_items", "test_latency_loss.py::test_no_new_false_tool_calls", "false_tool_calls_tool_absent")]


@pytest.fixture
def no_ci(monkeypatch):
    for name in ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "CIRCLECI", "TF_BUILD"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("count", "test", "check"), SLICES, ids=[s[0] for s in SLICES])
def test_empty_slice_is_not_measured(pytester, gates_project, make_run, own_profile, no_ci, count, test, check):
    gates_project()
    run = make_run(**{f"quality.student.{count}": 0})
    result = pytester.runpytest(f"gates/{test}", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-report=gates.json")
    result.assert_outcomes(skipped=1)
    report = json.loads((pytester.path / "gates.json").read_text())
    assert report["summary"] == {"not measured": 1}
    (record,) = report["gates"]
    assert record["name"] == check and record["verdict"] == "not measured" and record["n"] == 0
    assert record["reason"].startswith("not measured (0 items): no eval item")


@pytest.mark.parametrize(("count", "test", "check"), SLICES, ids=[s[0] for s in SLICES])
def test_empty_slice_fails_under_ci(pytester, gates_project, make_run, own_profile, no_ci, monkeypatch, count, test,
                                    check):
    gates_project()
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    run = make_run(**{f"quality.student.{count}": 0})
    result = pytester.runpytest(f"gates/{test}", f"--run-dir={run}", f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*{check}*not measured (0 items)*fails under CI (GITHUB_ACTIONS=true) unless "
                                 f"gates.waive names '{check}'*"])


def test_waived_gate_is_not_measured_under_ci_and_flagged_looser(pytester, gates_project, make_run, own_profile,
                                                                  no_ci, monkeypatch):
    gates_project()
    monkeypatch.setenv("CI", "1")
    own = project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  waive: [privacy_ok_rate]\n")
    run = make_run(**{"quality.student.items_with_pii": 0})
    result = pytester.runpytest("gates/test_privacy.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-report=gates.json")
    result.assert_outcomes(skipped=1, passed=1)
    report = json.loads((pytester.path / "gates.json").read_text())
    skipped = next(t for t in report["tests"] if t["outcome"] == "not measured")
    assert f"waived by {own} (gates.waive)" in skipped["reason"]
    assert "LOOSER than the embedded defaults: waive ['privacy_ok_rate'] (embedded [])" in \
        report["session"]["thresholds_source"]


def test_counts_show_their_n(pytester, gates_project, make_run, own_profile):
    gates_project()
    pytester.runpytest("gates/test_privacy.py", "gates/test_latency_loss.py", f"--run-dir={make_run()}",
                       f"--hw-profile={own_profile}", "--gate-report=gates.json").assert_outcomes(passed=5)
    n = {g["name"]: g["n"] for g in json.loads((pytester.path / "gates.json").read_text())["gates"]}
    assert n == {"privacy_ok_rate": 360, "controls_with_integration": 30, "median_tokens_out_ratio": 200,
                 "false_tool_calls_tool_absent": 40, "ttfa_tokens_p95": 150}


def test_a_report_without_slice_counts_fails(pytester, gates_project, make_run, own_profile):
    from .conftest import DELETE

    gates_project()
    run = make_run(**{"quality.student.control_items": DELETE})
    result = pytester.runpytest("gates/test_privacy.py::test_controls_with_integration", f"--run-dir={run}",
                                f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*does not count the eval items labelled control or decline*"])
