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
from distillgates.gates.outcomes import TestOutcome, summarize_tests
from distillgates.io import atomic_write_json, atomic_write_text

VERDICT_STYLE = {"pass": "green", "blessed": "cyan", "fail": "bold red", "error": "bold red", "inconclusive": "yellow",
                 "stopped": "dim", "not measured": "yellow", "underpowered": "yellow", "deselected": "dim"}


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


def unreported(tests: list[TestOutcome], records: list[GateRecord]) -> list[TestOutcome]:
    """The tests whose outcome no check of theirs shows (no check recorded, a crash after some checks, a skip,
    a deselection): each gets a row of its own in the tables."""
    verdicts: dict[str, set[str]] = {}
    for r in records:
        verdicts.setdefault(r.nodeid, set()).add(r.verdict)
    return [t for t in tests if t.outcome not in verdicts.get(t.nodeid, set())]


def counts_line(result: dict[str, Any]) -> str:
    """``FAIL: 7 error, 2 pass`` (gate tests by outcome), one line for every report."""
    counts = ", ".join(f"{n} {v}" for v, n in result["tests"].items()) or "no gate test"
    return f"{result['verdict'].upper()}: {counts} ({result['reason']})"


def build_report(records: list[GateRecord], tests: list[TestOutcome], session: dict[str, Any]) -> dict[str, Any]:
    """The JSON gate report: session header, the result, the gate tests by outcome (``summary``), the checks by
    verdict (``checks``), every gate test with its outcome and every check."""
    return {"schema_version": 2, "session": session, "result": session["result"]["verdict"],
            "summary": summarize_tests(tests), "checks": summarize(records),
            "tests": [t.to_dict() for t in tests], "gates": [r.to_dict() for r in records]}


def write_json_report(path: str | Path, records: list[GateRecord], tests: list[TestOutcome],
                      session: dict[str, Any]) -> None:
    atomic_write_json(path, build_report(records, tests, session))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_summary(records: list[GateRecord], tests: list[TestOutcome], session: dict[str, Any]) -> str:
    """A Markdown table of gates that fits a GitHub/GitLab job summary: every check, and a row for every gate test
    whose outcome no check shows."""
    checks = ", ".join(f"{n} {v}" for v, n in summarize(records).items()) or "none"
    lines = [
        "## distillgates gates",
        "",
        f"**{counts_line(session['result'])}**",
        "",
        f"Hardware profile `{session.get('hardware_profile_key')}`, bless={session.get('bless')}; checks: {checks}.",
        "",
        f"Thresholds: {_thresholds_label(session.get('thresholds_source'))}.",
        "",
        "| verdict | gate | check | measured | n | 95% CI | threshold | baseline | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r.verdict} | {r.group} | `{r.name}` | {_short(r.measured)} | {_short(r.n)} | {_ci(r)} | "
                     f"{_short(r.threshold)} | {_short(r.baseline)} | {_cell(r.reason)} |")
    for t in unreported(tests, records):
        lines.append(f"| {t.outcome} | {t.group} | `{t.name}` | — | — | — | — | — | {_cell(t.reason)} |")
    for key in ("unused_baselines", "written_baselines"):
        if session.get(key):
            lines += ["", f"**{key.replace('_', ' ')}:**", *[f"- `{item}`" for item in session[key]]]
    return "\n".join(lines) + "\n"


def write_markdown_summary(path: str | Path, records: list[GateRecord], tests: list[TestOutcome],
                           session: dict[str, Any]) -> None:
    atomic_write_text(path, markdown_summary(records, tests, session))


def rich_table(records: list[GateRecord], tests: list[TestOutcome], thresholds_source: str | None) -> Table:
    """Every check, and a row for every gate test whose outcome no check shows (its reason under the name)."""
    table = Table(title="distillgates gates", caption=Text(f"thresholds: {thresholds_source or 'none used'}"),
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
    for t in unreported(tests, records):
        name = Text(t.name + (f"\n{t.reason}" if t.reason else ""))
        table.add_row(Text(t.outcome, style=VERDICT_STYLE.get(t.outcome, "")), Text(t.group), name,
                      *[Text("—")] * 5)
    return table
