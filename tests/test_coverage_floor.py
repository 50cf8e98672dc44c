"""``tools/coverage_floor.py``, make test's coverage floor: lines and branches checked apart, each failing alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def _floor_main():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("coverage_floor", REPO / "tools" / "coverage_floor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_each_floor_fails_alone_and_names_its_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A measured module with 4 of 5 lines and 1 of 2 branches run: 80% of lines, 50% of branches."""
    (tmp_path / "measured.py").write_text("def f(x):\n    if x:\n        return 1\n    return 2\n\n\nf(1)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE")}  # not the measurement of make test
    subprocess.run([sys.executable, "-m", "coverage", "run", "--branch", "--data-file=.coverage", "measured.py"],
                   cwd=tmp_path, env=env, check=True)  # fmt: skip
    main = _floor_main()
    data = ["--data-file", str(tmp_path / ".coverage")]
    assert main(["--line", "80", "--branch", "50", *data]) == 0
    assert "lines 80.0% (4/5, floor 80%), branches 50.0% (1/2, floor 50%)" in capsys.readouterr().out
    assert main(["--line", "81", "--branch", "50", *data]) == 1
    assert "coverage floor not met: lines 80.0% < 81%" in capsys.readouterr().err
    assert main(["--line", "80", "--branch", "90", *data]) == 1
    assert "coverage floor not met: branches 50.0% < 90%" in capsys.readouterr().err
