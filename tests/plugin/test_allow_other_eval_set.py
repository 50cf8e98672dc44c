"""--allow-other-eval-set: a baseline blessed on another eval set is refused unless allowed; one that
records no fingerprints (an old baseline) is refused and must be re-blessed."""

from __future__ import annotations

import copy
import json

import pytest

from distillgates.gates.baselines import EVAL_SET_KEYS
from distillgates.model import model_fingerprint, save_model
from distillgates.rundir import RunDir

from .conftest import tiny_student

F1_DRIFT = "gates/test_f1_drift.py"


def bless(pytester, make_run, own_profile) -> list[str]:
    args = [F1_DRIFT, f"--hw-profile={own_profile}"]
    pytester.runpytest(*args, f"--run-dir={make_run('blessed')}", "--bless").assert_outcomes(passed=2)
    return args


@pytest.mark.parametrize("key", EVAL_SET_KEYS)
def test_baseline_of_another_eval_set_is_refused(pytester, gates_project, make_run, own_profile, key):
    gates_project()
    args = bless(pytester, make_run, own_profile)
    blessed = json.loads(RunDir(make_run("blessed")).report.read_text())["header"]["fingerprints"][key]
    run = make_run("other", **{f"header.fingerprints.{key}": "e" * 64})
    result = pytester.runpytest(*args, f"--run-dir={run}")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*baselines/common/f1_drift.json: entries.f1_lax_macro was blessed on another eval "
                                 f"set ({key}: baseline {blessed!r}, run {'e' * 64!r}); refusing to compare metrics "
                                 "of different eval sets (pass --allow-other-eval-set to accept, or re-bless: *"])
    pytester.runpytest(*args, f"--run-dir={run}", "--allow-other-eval-set").assert_outcomes(passed=2)


def test_another_model_is_what_a_baseline_compares(pytester, gates_project, make_run, own_profile):
    """The model and runner fingerprints are not part of the eval set: a new student is compared."""
    gates_project()
    args = bless(pytester, make_run, own_profile)
    other = copy.deepcopy(tiny_student())
    other.embed.weight.data.mul_(1.01)  # a retrained student: its report describes it
    run = make_run("retrained", **{"header.fingerprints.model_fingerprint": model_fingerprint(other),
                                   "header.fingerprints.runner_fingerprint": "f" * 64})
    save_model(RunDir(run).model_path(), other)
    pytester.runpytest(*args, f"--run-dir={run}").assert_outcomes(passed=2)


@pytest.mark.parametrize("allow", [False, True])
def test_baseline_without_fingerprints_must_be_reblessed(pytester, gates_project, make_run, own_profile, allow):
    gates_project()
    args = bless(pytester, make_run, own_profile)
    path = pytester.path / "baselines" / "common" / "f1_drift.json"
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        del entry["fingerprints"]  # as blessed before entries recorded them
    path.write_text(json.dumps(data))
    result = pytester.runpytest(*args, f"--run-dir={make_run('blessed')}", *(["--allow-other-eval-set"] * allow))
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*f1_drift.json: entries.f1_lax_macro records no fingerprints (blessed before "
                                 "baselines recorded the eval set they were measured on); re-bless it: "
                                 "pytest *--bless*"])
