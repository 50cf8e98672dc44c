"""Progress: a rich bar on a terminal; plain lines in a log (each 10% or 30 s, and at the end)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
from rich.console import Console

from distillgates.progress import ProgressBar, ProgressLines


def _log(buffer: io.StringIO) -> list[str]:
    return buffer.getvalue().splitlines()


def test_a_log_gets_a_line_each_tenth_and_one_at_the_end() -> None:
    buffer = io.StringIO()
    with ProgressBar("teacher", 95, console=Console(file=buffer, force_terminal=False), loss=float("nan")) as bar:
        for step in range(95):
            bar.update(1, loss=1.0 / (step + 1))
    lines = _log(buffer)
    assert len(lines) == 10  # 10%, 20%, ... 90%, then the end (95/95)
    assert lines[0].startswith("teacher  10/95 (11%)  elapsed 0:00:00  eta 0:00:00  loss 0.1")
    assert lines[-1].startswith("teacher  95/95 (100%)") and lines[-1].endswith("loss 0.01053")


def test_a_slow_step_prints_every_30_seconds() -> None:
    now = [0.0]
    buffer = io.StringIO()
    lines = ProgressLines("KD set", 1000, completed=100, console=Console(file=buffer), clock=lambda: now[0])
    for done in (101, 102, 103):
        now[0] += 31.0  # each item takes 31 s: far from the next 10%, a line anyway
        lines.update(done, "spent $0.01")
    log = _log(buffer)
    assert len(log) == 3
    # a resumed step: the rate is this session's (3 items in 93 s), the eta the remaining 897 items at that rate
    assert log[-1] == "KD set  103/1000 (10%)  elapsed 0:01:33  eta 7:43:27  spent $0.01"
    lines.close("spent $0.01")
    assert len(_log(buffer)) == 3  # the last state was just printed


def test_a_terminal_gets_the_rich_bar_and_no_lines() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    with ProgressBar("eval", 10, console=console) as bar:
        for _ in range(10):
            bar.update(1)
    assert "10/10" in buffer.getvalue() and "elapsed" not in buffer.getvalue()


def test_a_disabled_bar_prints_nothing() -> None:
    buffer = io.StringIO()
    with ProgressBar("eval", 10, enabled=False, console=Console(file=buffer)) as bar:
        bar.update(5)
    assert buffer.getvalue() == ""


@pytest.mark.integration  # a Python process (~2 s)
def test_the_default_console_writes_lines_when_stderr_is_a_pipe() -> None:
    code = ("from distillgates.progress import ProgressBar\n"
            "with ProgressBar('train', 20, loss=0.5) as bar:\n"
            "    for _ in range(20): bar.update(1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert re.findall(r"^train  (\d+)/20", out.stderr, flags=re.MULTILINE) == [str(n) for n in range(2, 21, 2)]
