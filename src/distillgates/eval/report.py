"""The one report format (eval + speed + gate inputs): build, validate, write, read, render.

The JSON Schema ships with the package (``distillgates/schemas/report.schema.json``). A report
is validated on write (then written atomically) and again on read, so a gate never reads a
truncated, hand-edited or stale report. A null fingerprint, an older ``schema_version`` and a
schema violation each raise :class:`ReportError` naming the file and the field.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from rich.table import Table
from rich.text import Text

from distillgates.eval.fingerprints import FingerprintError, check_fingerprints
from distillgates.io import atomic_write_json

SCHEMA_VERSION = 1
QUALITY_COLUMNS = (
    "n",
    "tool_selection",
    "json_validity",
    "arg_match_strict",
    "arg_match_lax",
    "f1_strict_macro",
    "f1_lax_macro",
    "f1_strict_micro",
    "f1_lax_micro",
    "privacy_ok_rate",
    "controls_with_integration",
    "fixture_hit_rate",
    "median_tokens_out",
    "median_tokens_out_tool_items",
    "false_tool_calls_tool_absent",
    "ttfa_tokens_p50",
    "ttfa_tokens_p95",
)


class ReportError(ValueError):
    """A report is invalid, from another schema version, or has a null fingerprint."""


@cache
def report_schema() -> dict[str, Any]:
    text = resources.files("distillgates").joinpath("schemas/report.schema.json").read_text()
    schema = json.loads(text)
    Draft202012Validator.check_schema(schema)
    return schema


def validate_report(report: Any, where: str = "<report>") -> dict[str, Any]:
    """Return ``report`` if it is a valid current-version report, else raise :class:`ReportError`."""
    if not isinstance(report, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(report).__name__}")
    version = report.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportError(f"{where}: schema_version: missing or not an integer (found {version!r})")
    if version < SCHEMA_VERSION:
        raise ReportError(
            f"{where}: schema_version {version} is older than the supported version {SCHEMA_VERSION}; "
            "re-run `distillgates eval` to regenerate the report"
        )
    if version > SCHEMA_VERSION:
        raise ReportError(
            f"{where}: schema_version {version} is newer than this distillgates supports ({SCHEMA_VERSION}); upgrade"
        )
    try:
        check_fingerprints((report.get("header") or {}).get("fingerprints"), f"{where}: header.fingerprints")
        for role, metrics in (report.get("quality") or {}).items():
            if isinstance(metrics, dict) and "fingerprints" in metrics:
                check_fingerprints(metrics["fingerprints"], f"{where}: quality.{role}.fingerprints")
    except FingerprintError as err:
        raise ReportError(str(err)) from err
    errors = sorted(Draft202012Validator(report_schema()).iter_errors(report), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:10]]
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        raise ReportError(f"{where}: report does not match the schema:\n  " + "\n  ".join(lines) + more)
    return report


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Validate, then write atomically. Nothing is written when validation fails."""
    path = Path(path)
    validate_report(report, str(path))
    atomic_write_json(path, report)
    return path


def read_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a report; a corrupted file names the file and the JSON error position."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from err
    return validate_report(report, str(path))


# --------------------------------------------------------------------------------------
# Building


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def default_hardware() -> dict[str, Any]:
    """A minimal hardware header (the hardware module's detection replaces it when present)."""
    import torch

    try:
        import coremltools

        ct_version: str | None = coremltools.__version__
    except ImportError:
        ct_version = None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    return {
        "soc": platform.processor() or platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "ram_gb": round(ram, 1) if ram else None,
        "torch_version": torch.__version__,
        "coremltools_version": ct_version,
        "export_path": None,
        "hardware_profile_key": "unprofiled",
    }


def build_report(
    *,
    fingerprints: dict[str, str],
    quality: dict[str, Any] | None = None,
    speed: dict[str, Any] | None = None,
    gate_inputs: dict[str, Any] | None = None,
    hardware: dict[str, Any] | None = None,
    config_sha256: str = "",
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a report dict (validated when written)."""
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "header": {
            "hardware": hardware or default_hardware(),
            "fingerprints": dict(fingerprints),
            "config_sha256": config_sha256 or "none",
            "git_sha": _git_sha(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
        },
    }
    if config is not None:
        report["header"]["config"] = config
    for key, value in (("quality", quality), ("speed", speed), ("gate_inputs", gate_inputs)):
        if value is not None:
            report[key] = value
    return report


# --------------------------------------------------------------------------------------
# Rendering


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _quality_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    roles = list((report.get("quality") or {}).keys())
    rows = [[metric, *(_fmt(report["quality"][r].get(metric)) for r in roles)] for metric in QUALITY_COLUMNS]
    return roles, rows


def _speed_rows(report: dict[str, Any]) -> list[list[str]]:
    speed = report.get("speed") or {}
    rows = []
    for key in ("ttft_ms", "tokenizer_ms", "first_step_ms", "tps", "ttfa_tokens", "ttfa_ms"):
        if isinstance(speed.get(key), dict):
            rows.append([key, *(_fmt(speed[key].get(p)) for p in ("p50", "p90", "p95"))])
    return rows


def _ane_rows(report: dict[str, Any]) -> list[list[str]]:
    """The ANE figures, each named with its source: a static op-eligibility lint is not residency."""
    inputs = report.get("gate_inputs") or {}
    rows = []
    if "skipped" in inputs.get("ane_lint", {}):
        rows.append(["ANE op lint", f"skipped: {inputs['ane_lint']['skipped']}"])
    elif "ane_lint" in inputs:
        lint = inputs["ane_lint"]
        rows.append([f"ANE op-eligible share [{lint['source']}]", _fmt(lint["op_eligible_share"])])
        rows.append([f"ANE lint findings [{lint['source']}]",
                     f"{len(lint['ineligible_ops'])} ineligible ops, {len(lint['over_limits'])} over limits"])
    plan = inputs.get("ane_residency") or {}  # per function of the package (prefill_<L>, decode)
    for function, measured in plan.get("functions", {}).items():
        shares = ", ".join(f"{d} {_fmt(measured[f'{d}_share'])}" for d in ("gpu", "cpu") if f"{d}_share" in measured)
        rows.append([f"ANE residency, {function} [{plan['source']}]",
                     _fmt(measured["residency"]) + (f" ({shares})" if shares else "")])
    return rows


def render_report(report: dict[str, Any]) -> Table:
    """A ``rich`` table: quality per role, speed percentiles, ANE figures (by source), fingerprints."""
    roles, rows = _quality_rows(report)
    table = Table(title=f"distillgates report (schema v{report.get('schema_version')})")
    table.add_column("metric")
    for role in roles or ["value"]:
        table.add_column(role, justify="right")
    for row in rows if roles else []:
        table.add_row(*row)
    for key, p50, p90, p95 in _speed_rows(report):
        table.add_row(f"speed.{key} p50/p90/p95", f"{p50} / {p90} / {p95}", *[""] * (max(len(roles), 1) - 1))
    for name, value in _ane_rows(report):  # Text, not markup: "[MLComputePlan]" is no style tag
        table.add_row(Text(name), value, *[""] * (max(len(roles), 1) - 1))
    for key, value in report["header"]["fingerprints"].items():
        table.add_row(key, value[:16], *[""] * (max(len(roles), 1) - 1))
    return table


def report_markdown(report: dict[str, Any]) -> str:
    """Markdown (CI job summary): quality table, speed table, ANE figures (by source), gate inputs, fingerprints."""
    header = report["header"]
    out = [f"# distillgates report (schema v{report['schema_version']})", ""]
    out.append(f"created {header['created_at']}, git {header.get('git_sha') or 'n/a'}, "
               f"hardware `{header['hardware'].get('hardware_profile_key')}`")  # fmt: skip
    roles, rows = _quality_rows(report)
    if roles:
        out += ["", "## Quality", "", "| metric | " + " | ".join(roles) + " |", "|---|" + "---:|" * len(roles)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
    speed_rows = _speed_rows(report)
    if speed_rows:
        out += ["", "## Speed", "", "| metric | p50 | p90 | p95 |", "|---|---:|---:|---:|"]
        out += ["| " + " | ".join(row) + " |" for row in speed_rows]
    ane_rows = _ane_rows(report)
    if ane_rows:
        out += ["", "## ANE", "", "| figure [source] | value |", "|---|---:|"]
        out += ["| " + " | ".join(row) + " |" for row in ane_rows]
    for name, section in (report.get("gate_inputs") or {}).items():
        if isinstance(section, dict):
            flat = ", ".join(f"{k}={_fmt(v)}" for k, v in section.items() if not isinstance(v, dict | list))
            out.append(f"- gate input `{name}`: {flat}")
    out += ["", "## Fingerprints", "", "| key | value |", "|---|---|"]
    out += [f"| {k} | `{v}` |" for k, v in header["fingerprints"].items()]
    return "\n".join(out) + "\n"
