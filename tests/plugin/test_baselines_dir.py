"""--baselines-dir: where baselines live (default: the project's `baselines` setting, else baselines/ under the
rootdir)."""

from __future__ import annotations


def test_custom_baselines_dir(pytester, gates_project, make_run, own_profile, tmp_path):
    gates_project()
    store = tmp_path / "store"
    args = ["gates/test_f1_drift.py", f"--run-dir={make_run()}", f"--hw-profile={own_profile}",
            f"--baselines-dir={store}"]
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=2)
    assert (store / "common" / "f1_drift.json").is_file()
    assert not (pytester.path / "baselines").exists()
    pytester.runpytest(*args).assert_outcomes(passed=2)
    result = pytester.runpytest(*args[:-1])  # default baselines/ is empty: the gates fail loudly
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*missing baseline*baselines/common/f1_drift.json*"])


def test_the_projects_baselines_setting(pytester, gates_project, make_run, own_profile):
    gates_project()
    (pytester.path / "distillgates.yaml").write_text("baselines: ci/blessed\n")
    args = ["gates/test_f1_drift.py", f"--run-dir={make_run()}", f"--hw-profile={own_profile}"]
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=2)
    assert (pytester.path / "ci" / "blessed" / "common" / "f1_drift.json").is_file()
    assert not (pytester.path / "baselines").exists()
    pytester.runpytest(*args).assert_outcomes(passed=2)
