"""One ``rich`` progress bar for every long step (training, KD set, evaluation)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressBar:
    """``bar.update(advance=1, completed=None, **fields)``; a disabled bar does nothing.

    ``fields`` are shown after the counter (e.g. ``loss=0.41``), so a bar says what it is doing.
    """

    def __init__(self, label: str, total: int, completed: int = 0, enabled: bool = True, **fields: Any) -> None:
        self._progress: Progress | None = None
        self._fields = fields
        if enabled:
            self._progress = Progress(
                TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
            )  # fmt: skip
            self._task = self._progress.add_task(label, total=total, completed=completed, info=self._info(fields))
            self._progress.start()

    @staticmethod
    def _info(fields: dict[str, Any]) -> str:
        return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())

    def update(self, advance: int = 1, completed: int | None = None, **fields: Any) -> None:
        if self._progress is None:
            return
        self._fields.update(fields)
        if completed is not None:
            self._progress.update(self._task, completed=completed, info=self._info(self._fields))
        else:
            self._progress.update(self._task, advance=advance, info=self._info(self._fields))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
