"""Step code fingerprints: each step is keyed by the code it runs, docstrings and comments aside."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from distillgates.codeversion import PACKAGE_ROOT, step_code
from distillgates.pipeline import STEPS


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """A copy of the package's sources to edit (fingerprints are read from files, nothing is imported)."""
    return Path(shutil.copytree(PACKAGE_ROOT, tmp_path / "distillgates", ignore=shutil.ignore_patterns("__pycache__")))


def fingerprints(package_root: Path) -> dict[str, dict[str, str]]:
    return {step.name: step_code(step.run.__module__, step.run.__name__, package_root) for step in STEPS}


def changed_steps(package_root: Path, edit: str, old: str, new: str) -> set[str]:
    """Steps whose fingerprint changes when ``old`` becomes ``new`` in ``edit`` (old "": append ``new``)."""
    before = fingerprints(package_root)
    path = package_root / edit
    text = path.read_text()
    assert old in text, f"{edit}: the test's anchor {old!r} moved"
    path.write_text(text.replace(old, new, 1) if old else text + new)
    after = fingerprints(package_root)
    return {name for name in before if before[name] != after[name]}


def test_the_copy_fingerprints_like_the_package(package_copy: Path) -> None:
    assert fingerprints(package_copy) == {step.name: step.code for step in STEPS}


def test_a_docstring_or_comment_edit_in_the_scorer_reruns_nothing(package_copy: Path) -> None:
    scorer = package_copy / "eval" / "scorer.py"
    first_line = scorer.read_text().splitlines()[0]
    assert changed_steps(package_copy, "eval/scorer.py", first_line, first_line + " Edited.\n# a new comment") == set()


def test_a_code_edit_in_the_scorer_reruns_only_eval_and_the_teacher_check(package_copy: Path) -> None:
    """The scorer's metrics are computed by the eval step and the teacher check (the steps after them follow their
    outputs' checksums: the same figures re-run nothing), and by coreai_eval (the asset's outputs scored); what
    training and the KD set share with it lives in ``eval/matching.py``. The teacher's training never re-runs."""
    assert changed_steps(package_copy, "eval/scorer.py", "", "\nEDITED = 1\n") == {"check", "eval", "coreai_eval"}


def test_a_code_edit_in_value_matching_reruns_what_matches_values(package_copy: Path) -> None:
    """Fixture lookup (the KD set's conversations) and the latency loss match values: they re-run."""
    changed = changed_steps(package_copy, "eval/matching.py", "", "\nEDITED = 1\n")
    assert changed == {"check", "kd", "student", "drafter", "eval", "coreai_eval"}


def test_a_code_edit_in_report_rendering_reruns_only_the_report(package_copy: Path) -> None:
    assert changed_steps(package_copy, "eval/report.py", "", "\nEDITED = 1\n") == {"report"}


def test_a_step_function_edit_reruns_only_that_step(package_copy: Path) -> None:
    head = "def step_speed(cfg: Config, run: RunDir) -> dict[str, Any]:\n"
    assert changed_steps(package_copy, "pipeline.py", head, head + "    _ = 1\n") == {"speed"}


def test_type_checking_imports_are_not_code(package_copy: Path) -> None:
    """``rundir.py`` names the model only under ``TYPE_CHECKING``; a model edit re-runs what loads models."""
    changed = changed_steps(package_copy, "model.py", "", "\nEDITED = 1\n")
    assert "data" not in changed and {"student", "export", "speed", "eval"} <= changed


def test_an_export_edit_never_retrains(package_copy: Path) -> None:
    """Training measures speed proxies with the PyTorch engine; the Core ML runtime (and with it the export
    code) is imported only by the export and speed steps, and by coreai_eval (Core AI's engine)."""
    assert changed_steps(package_copy, "export/lint.py", "", "\nEDITED = 1\n") == {"export", "speed", "coreai_eval"}
