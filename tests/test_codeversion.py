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
    before = fingerprints(package_root)
    path = package_root / edit
    text = path.read_text()
    assert old in text, f"{edit}: the test's anchor {old!r} moved"
    path.write_text(text.replace(old, new, 1))
    after = fingerprints(package_root)
    return {name for name in before if before[name] != after[name]}


def test_the_copy_fingerprints_like_the_package(package_copy: Path) -> None:
    assert fingerprints(package_copy) == {step.name: step.code for step in STEPS}


def test_a_docstring_or_comment_edit_in_the_scorer_reruns_nothing(package_copy: Path) -> None:
    scorer = package_copy / "eval" / "scorer.py"
    first_line = scorer.read_text().splitlines()[0]
    assert changed_steps(package_copy, "eval/scorer.py", first_line, first_line + " Edited.\n# a new comment") == set()


def test_a_code_edit_in_the_scorer_leaves_the_upstream_steps_cached(package_copy: Path) -> None:
    """The scorer is run by eval (and, through the latency losses' coverage check, by training): the
    data, the teacher, the KD set and the export never re-run for it."""
    changed = changed_steps(package_copy, "eval/scorer.py", "\ndef ", "\nEDITED = 1\n\n\ndef ")
    assert changed.isdisjoint({"data", "teacher", "kd", "export"})
    assert {"eval", "report"} <= changed


def test_a_step_function_edit_reruns_only_that_step(package_copy: Path) -> None:
    head = "def step_speed(cfg: Config, run: RunDir) -> dict[str, Any]:\n"
    assert changed_steps(package_copy, "pipeline.py", head, head + "    _ = 1\n") == {"speed"}


def test_type_checking_imports_are_not_code(package_copy: Path) -> None:
    """``rundir.py`` names the model only under ``TYPE_CHECKING``; a model edit re-runs what loads models."""
    changed = changed_steps(package_copy, "model.py", "\nclass RMSNorm", "\nEDITED = 1\n\n\nclass RMSNorm")
    assert "data" not in changed and {"student", "export", "speed", "eval"} <= changed
