"""Gate reports: JSON (``--gate-report``), Markdown (``--gate-summary``, a CI job summary) and
the ``rich`` terminal table. All written atomically at session end."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from distillgates.gates.core import GateRecord
from distillgates.io import atomic_write_json, atomic_write_text

VERDICT_STYLE = {"pass": "green", "blessed": "cyan", "fail": "bold red", "inconclusive": "yellow", "stopped": "dim"}


_DIGEST = re.compile(r"[0-9a-f]{32,}")


def _short(value: Any) -> str:
    """A table cell: floats to 4 significant digits, digests to a 12-character prefix, other text
    cut at 24 characters (the JSON report has every value whole)."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if _DIGEST.fullmatch(text):
        return text[:12] + "…"
    return text if len(text) <= 24 else text[:23] + "…"


def _ci(record: GateRecord) -> str:
    """A table cell: the measured value's confidence interval, ``—`` when it is not an estimate."""
    return "—" if record.ci is None else f"[{record.ci[0]:.4g}, {record.ci[1]:.4g}]"


def _thresholds_label(source: str | None) -> str:
    return f"`{source}`" if source else "none used"


def summarize(records: list[GateRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.verdict for r in records).items()))


def build_report(records: list[GateRecord], session: dict[str, Any]) -> dict[str, Any]:
    """The JSON gate report: session header, verdict counts and every check."""
    return {"schema_version": 1, "session": session, "summary": summarize(records),
            "gates": [r.to_dict() for r in records]}


def write_json_report(path: str | Path, records: list[GateRecord], session: dict[str, Any]) -> None:
    atomic_write_json(path, build_report(records, session))


def markdown_summary(records: list[GateRecord], session: dict[str, Any]) -> str:
    """A Markdown table of gates that fits a GitHub/GitLab job summary."""
    counts = ", ".join(f"{n} {v}" for v, n in summarize(records).items()) or "no gates ran"
    lines = [
        "## distillgates gates",
        "",
        f"Hardware profile `{session.get('hardware_profile_key')}`, bless={session.get('bless')}: {counts}.",
        "",
        f"Thresholds: {_thresholds_label(session.get('thresholds_source'))}.",
        "",
        "| verdict | gate | check | measured | n | 95% CI | threshold | baseline | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.verdict} | {r.group} | `{r.name}` | {_short(r.measured)} | {_short(r.n)} | {_ci(r)} | "
                     f"{_short(r.threshold)} | {_short(r.baseline)} | {reason} |")
    for key in ("unused_baselines", "written_baselines"):
        if session.get(key):
            lines += ["", f"**{key.replace('_', ' ')}:**", *[f"- `{item}`" for item in session[key]]]
    return "\n".join(lines) + "\n"


def write_markdown_summary(path: str | Path, records: list[GateRecord], session: dict[str, Any]) -> None:
    atomic_write_text(path, markdown_summary(records, session))


def rich_table(records: list[GateRecord], thresholds_source: str | None) -> Table:
    table = Table(title="distillgates gates", caption=f"thresholds: {thresholds_source or 'none used'}",
                  show_lines=False)
    for column in ("verdict", "gate", "check"):
        table.add_column(column, overflow="fold")
    for column in ("measured", "n", "95% CI", "threshold", "baseline"):  # narrow value columns: width to the names
        table.add_column(column, overflow="fold", max_width=16)
    for r in records:
        style = VERDICT_STYLE.get(r.verdict, "")
        # Text, not markup: check names such as "cosine[shape=128]" must not be read as style tags.
        table.add_row(Text(r.verdict, style=style), Text(r.group), Text(r.name), Text(_short(r.measured)),
                      Text(_short(r.n)), Text(_ci(r)), Text(_short(r.threshold)), Text(_short(r.baseline)))
    return table
