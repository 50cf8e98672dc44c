"""One progress display for every long step (teacher and student training, KD set, evaluation).

On a terminal it is a ``rich`` bar. Elsewhere (a CI log, a file) a live bar shows nothing until
the step ends, so a 6-minute teacher step would look hung: there the same updates print plain
lines instead, one each 10% of the total or every 30 s, whichever comes first, and one at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LINE_EVERY_FRACTION = 0.10  # non-terminal output: a line each 10% of the total ...
LINE_EVERY_S = 30.0  # ... or after 30 s without one


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """Progress as plain lines for a log: ``label  n/total (p%)  elapsed h:mm:ss  eta h:mm:ss  fields``."""

    def __init__(self, label: str, total: int, completed: int, console: Console,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.completed = label, total, completed
        self._console, self._clock = console, clock
        self._start = clock()
        self._start_completed = completed  # a resumed step: the rate counts this session's work only
        self._last_line = self._start
        self._last_fraction = self._fraction()
        self._last_completed: int | None = None  # at the last line printed

    def _fraction(self) -> float:
        return self.completed / self.total if self.total > 0 else 1.0

    def line(self, info: str) -> str:
        elapsed = self._clock() - self._start
        done_here = self.completed - self._start_completed
        eta = _clock(elapsed / done_here * (self.total - self.completed)) if done_here > 0 else "?"
        text = (f"{self.label}  {self.completed}/{self.total} ({self._fraction():.0%})  elapsed {_clock(elapsed)}"
                f"  eta {eta}")
        return f"{text}  {info}" if info else text

    def update(self, completed: int, info: str) -> None:
        self.completed = completed
        now, fraction = self._clock(), self._fraction()
        if fraction - self._last_fraction >= LINE_EVERY_FRACTION - 1e-9 or now - self._last_line >= LINE_EVERY_S:
            self._emit(info)
            self._last_fraction = fraction

    def close(self, info: str) -> None:
        if self._last_completed != self.completed:  # the end, unless its line was just printed
            self._emit(info)

    def _emit(self, info: str) -> None:
        self._last_line, self._last_completed = self._clock(), self.completed
        self._console.print(self.line(info), markup=False, highlight=False, soft_wrap=True)


class ProgressBar:
    """``bar.update(advance=1, completed=None, **fields)``; a disabled bar does nothing.

    ``fields`` are shown after the counter (e.g. ``loss=0.41``), so a bar says what it is doing.
    ``console`` (default: stderr) decides the display: a ``rich`` bar on a terminal, else
    :class:`ProgressLines`.
    """

    def __init__(self, label: str, total: int, completed: int = 0, enabled: bool = True,
                 console: Console | None = None, **fields: Any) -> None:
        self._progress: Progress | None = None
        self._lines: ProgressLines | None = None
        self._fields = fields
        self._completed = completed
        if not enabled:
            return
        console = console or Console(stderr=True)
        if not console.is_terminal:
            self._lines = ProgressLines(label, total, completed, console)
            return
        self._progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=console,
        )  # fmt: skip
        self._task = self._progress.add_task(label, total=total, completed=completed, info=self._info(fields))
        self._progress.start()

    @staticmethod
    def _info(fields: dict[str, Any]) -> str:
        return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())

    def update(self, advance: int = 1, completed: int | None = None, **fields: Any) -> None:
        if self._progress is None and self._lines is None:
            return
        self._fields.update(fields)
        self._completed = completed if completed is not None else self._completed + advance
        if self._lines is not None:
            self._lines.update(self._completed, self._info(self._fields))
        elif self._progress is not None:
            self._progress.update(self._task, completed=self._completed, info=self._info(self._fields))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._lines is not None:
            self._lines.close(self._info(self._fields))
            self._lines = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
