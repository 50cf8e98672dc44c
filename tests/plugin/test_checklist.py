"""The checklist ships with the plugin: collected from the installed package (no copy) when pytest gets no paths
in a distillgates project or with --run-dir; never in a project that merely has distillgates installed."""

from __future__ import annotations

import json

import pytest

from pytest_distillgates.checklist import CHECKLIST_DIR

PLAIN = "def test_plain():\n    assert True\n"


def _passed_failed(result: pytest.RunResult) -> tuple[int, int]:
    outcomes = result.parseoutcomes()
    return outcomes.get("passed", 0), outcomes.get("failed", 0)


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester project with one plain test (hypothesis/benchmark/xdist off: ~4 s per in-process run)."""
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider -p no:hypothesispytest -p no:benchmark -p no:xdist "
                     "--import-mode=importlib\n")
    pytester.makepyfile(test_plain=PLAIN)
    return pytester


def test_run_dir_collects_the_shipped_checklist(project, make_run, own_profile):
    result = project.runpytest(f"--run-dir={make_run()}", f"--hw-profile={own_profile}", "-m", "privacy", "-rA",
                               "--gate-report=gates.json")
    outcomes = result.parseoutcomes()
    assert (outcomes["passed"], outcomes.get("failed", 0)) == (2, 0)  # test_plain carries no privacy marker
    result.stdout.fnmatch_lines(["PASSED test_privacy.py::test_privacy_ok_rate*"])
    # outside the rootdir, a record names the shipped file itself: the bless command it prints runs anywhere
    records = json.loads((project.path / "gates.json").read_text())["gates"]
    assert records[0]["nodeid"] == f"{CHECKLIST_DIR / 'test_privacy.py'}::test_privacy_ok_rate"


def test_the_shipped_checklist_fails_a_violating_run(project, make_run, own_profile):
    run = make_run(**{"quality.student.controls_with_integration": 3})
    result = project.runpytest(f"--run-dir={run}", f"--hw-profile={own_profile}", "-m", "privacy")
    assert _passed_failed(result) == (1, 1)
    result.stdout.fnmatch_lines(["*gate privacy/controls_with_integration FAILED: measured 3 <= threshold 0*"])


def test_a_project_with_settings_collects_it_with_no_arguments(project):
    (project.path / "distillgates.yaml").write_text("baselines: baselines\n")
    result = project.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["test_plain.py::test_plain", "test_quality.py::test_quality[[]f1_lax_macro[]]",
                                 "test_shape_drift.py::test_shape_drift[[]128[]]"])
    assert "deselected" in result.stdout.str()  # the speed gates: opt-in with -m speed


def test_without_settings_or_run_dir_no_gate_is_collected(project):
    project.runpytest().assert_outcomes(passed=1)


def test_explicit_paths_collect_only_those(project, make_run):
    (project.path / "distillgates.yaml").write_text("baselines: baselines\n")
    project.runpytest("test_plain.py", f"--run-dir={make_run()}").assert_outcomes(passed=1)


def test_pyargs_collects_the_checklist_explicitly(project):
    result = project.runpytest("--pyargs", "pytest_distillgates.checklist", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*test_privacy.py::test_privacy_ok_rate"])
    assert "test_plain" not in result.stdout.str()


def test_a_projects_conftest_overrides_the_fixtures_of_the_shipped_gates(project, make_run, own_profile):
    project.makeconftest("import pytest\n\n\n@pytest.fixture(scope='session')\ndef student(report):\n"
                         "    return {**report.get('quality.student'), 'controls_with_integration': 5}\n")
    result = project.runpytest(f"--run-dir={make_run()}", f"--hw-profile={own_profile}", "-m", "privacy")
    assert _passed_failed(result) == (1, 1)
    result.stdout.fnmatch_lines(["*controls_with_integration FAILED: measured 5*"])


def test_bad_settings_stop_the_session_with_one_line(project):
    (project.path / "distillgates.yaml").write_text("thresholds: missing.yaml\nbaseline: b\n")
    result = project.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*distillgates.yaml:2: baseline: unknown key*"])
