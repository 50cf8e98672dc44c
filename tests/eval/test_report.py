"""Report schema: round trip, corrupted / old-schema / null-fingerprint reports rejected clearly."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from distillgates.data.generator import generate_items
from distillgates.eval.fingerprints import FINGERPRINT_KEYS
from distillgates.eval.report import (
    ReportError,
    build_report,
    read_report,
    render_report,
    report_markdown,
    validate_report,
    write_report,
)
from distillgates.eval.runners import reference_output
from distillgates.eval.scorer import score

FPS = {k: f"{k}-0123456789abcdef" for k in FINGERPRINT_KEYS}


def _pct(values: list[float]) -> dict[str, Any]:
    return {"p50": values[0], "p90": values[-1], "p95": values[-1], "samples": values}


@pytest.fixture
def report() -> dict[str, Any]:
    items = generate_items(0, 20, split="eval")
    metrics = score(
        items, [reference_output(i) for i in items], shapes={i["id"]: 150 for i in items}, lengths=[128, 192]
    )
    speed = {
        "backend": "torch", "export": False, "hardware_profile_key": "linux-ci", "ttft_ms": _pct([1.0, 2.0]),
        "tps": _pct([100.0, 120.0]), "kv_bytes": {"layers": 4, "kv_heads": 2, "head_dim": 32, "seq_len": 256,
                                                   "bytes_per_elem": 2, "bytes": 262144}, "peak_memory_bytes": 1,
    }  # fmt: skip
    determinism = {
        "coverage": 1.0,
        "duplicates": 0,
        "missing": 0,
        "mismatches": 0,
        "sharded_equal": True,
        "n_shards": 2,
    }
    return build_report(
        fingerprints=FPS, quality={"student": metrics, "teacher": copy.deepcopy(metrics)}, speed=speed,
        gate_inputs={"determinism": determinism}, config_sha256="abc",
    )  # fmt: skip


def test_round_trip_and_render(report: dict[str, Any], tmp_path: Path) -> None:
    path = write_report(tmp_path / "report.json", report)
    loaded = read_report(path)
    assert loaded["quality"]["student"]["tool_selection"] == 1.0
    assert loaded["quality"]["student"]["slices"]["shape"].keys() == {"192"}
    md = report_markdown(loaded)
    assert "| tool_selection | 1.0000 | 1.0000 |" in md and "dataset_sha256" in md
    assert render_report(loaded).row_count > len(FINGERPRINT_KEYS)


def test_ane_figures_are_labelled_by_source(report: dict[str, Any], tmp_path: Path) -> None:
    """The static lint's share and the compute plan's residency each carry their source, never mixed up."""
    from rich.console import Console

    report["gate_inputs"]["ane_lint"] = {
        "source": "op-eligibility lint (static MIL)", "ineligible_ops": ["prefill: cumsum (c): op cumsum not in the "
        "ANE op list"], "over_limits": [], "limits": {"max_rank": 5, "max_dim": 16384}, "op_eligible_share": 0.99997,
        "by_op_type": {},
    }  # fmt: skip
    md = report_markdown(read_report(write_report(tmp_path / "lint.json", report)))
    assert "| ANE op-eligible share [op-eligibility lint (static MIL)] | 1.0000 |" in md
    assert "| ANE lint findings [op-eligibility lint (static MIL)] | 1 ineligible ops, 0 over limits |" in md
    assert "residency" not in md  # no residency without MLComputePlan
    report["gate_inputs"]["ane_residency"] = {
        "source": "MLComputePlan",
        "functions": {
            "prefill_192": {"residency": 0.62, "by_op_type": {}},
            "decode": {"residency": 0.71, "gpu_share": 0.25, "cpu_share": 0.04, "by_op_type": {}},
        },
    }
    loaded = read_report(write_report(tmp_path / "plan.json", report))
    assert "| ANE residency, prefill_192 [MLComputePlan] | 0.6200 |" in report_markdown(loaded)
    assert "| ANE residency, decode [MLComputePlan] | 0.7100 (gpu 0.2500, cpu 0.0400) |" in report_markdown(loaded)
    console = Console(width=200, record=True)
    console.print(render_report(loaded))
    table = console.export_text()
    assert "ANE residency, prefill_192 [MLComputePlan]" in table
    assert "ANE op-eligible share [op-eligibility lint" in table
    report["gate_inputs"]["ane_residency"]["source"] = "op-eligibility lint (static MIL)"  # a lint is no residency
    with pytest.raises(ReportError, match=r"gate_inputs\.ane_residency\.source"):
        validate_report(report)


def test_report_command_renders_and_writes_markdown(report: dict[str, Any], tmp_path: Path, capsys) -> None:
    from distillgates.cli import main

    path = write_report(tmp_path / "report.json", report)
    assert main(["report", str(path), "--markdown", str(tmp_path / "summary.md")]) == 0
    assert "tool_selection" in capsys.readouterr().out
    assert (tmp_path / "summary.md").read_text() == report_markdown(read_report(path))
    path.write_text(path.read_text()[:200])
    assert main(["report", str(path)]) == 2  # a corrupted report: one clear error line, exit 2
    assert "report.json" in capsys.readouterr().err


def test_corrupted_file_rejected_with_position(report: dict[str, Any], tmp_path: Path) -> None:
    path = write_report(tmp_path / "report.json", report)
    path.write_text(path.read_text()[:200])  # truncated
    with pytest.raises(ReportError, match=r"report\.json:\d+:\d+: invalid JSON"):
        read_report(path)


def test_schema_violation_names_the_field(report: dict[str, Any], tmp_path: Path) -> None:
    report["quality"]["student"]["tool_selection"] = "high"
    with pytest.raises(ReportError, match=r"quality\.student\.tool_selection: 'high' is not of type"):
        write_report(tmp_path / "report.json", report)
    assert not (tmp_path / "report.json").exists()
    del report["quality"]["student"]["tool_selection"]
    with pytest.raises(ReportError, match="'tool_selection' is a required property"):
        validate_report(report)


def test_corrupted_values_on_disk_rejected(report: dict[str, Any], tmp_path: Path) -> None:
    path = write_report(tmp_path / "report.json", report)
    data = json.loads(path.read_text())
    data["gate_inputs"]["determinism"]["coverage"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"gate_inputs\.determinism\.coverage"):
        read_report(path)


def test_old_schema_version_rejected_clearly(report: dict[str, Any], tmp_path: Path) -> None:
    report["schema_version"] = 0
    path = tmp_path / "old.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError, match="schema_version 0 is older than the supported version 1; re-run"):
        read_report(path)


@pytest.mark.parametrize("key", FINGERPRINT_KEYS)
def test_null_fingerprint_rejected_on_write_and_read(report: dict[str, Any], tmp_path: Path, key: str) -> None:
    report["header"]["fingerprints"][key] = None
    with pytest.raises(ReportError, match=f"null or missing fingerprint.*{key}"):
        write_report(tmp_path / "report.json", report)
    path = tmp_path / "hand_written.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError, match=f"{key}"):
        read_report(path)


def test_zero_rate_is_valid_and_kept(report: dict[str, Any], tmp_path: Path) -> None:
    report["quality"]["student"]["privacy_ok_rate"] = 0.0
    loaded = read_report(write_report(tmp_path / "r.json", report))
    assert loaded["quality"]["student"]["privacy_ok_rate"] == 0.0


def test_a_coreai_only_export_validates_and_renders(report: dict[str, Any], tmp_path: Path) -> None:
    """``export.target coreai``: the export figures are the asset's, the lints and the ANE op lint skipped with a
    reason; a skipped lint without its reason, or a lint figure missing without one, is refused."""
    from distillgates.export.api import ANE_LINT_SKIPPED, LINTS_SKIPPED
    from distillgates.export.functions import COREAI_SOURCE

    report["gate_inputs"]["export"] = {"source": COREAI_SOURCE, "cosine_by_shape": {"192": 0.9999},
                                       "decode_cosine": [0.9999], "lints_skipped": LINTS_SKIPPED, "contract_ok": True}
    report["gate_inputs"]["ane_lint"] = {"skipped": ANE_LINT_SKIPPED}
    md = report_markdown(read_report(write_report(tmp_path / "coreai.json", report)))
    assert f"| ANE op lint | skipped: {ANE_LINT_SKIPPED} |" in md
    del report["gate_inputs"]["export"]["lints_skipped"]  # no lint figure, and no reason
    with pytest.raises(ReportError, match=r"gate_inputs\.export.*int64_on_attention"):
        validate_report(report)
    report["gate_inputs"]["export"]["lints_skipped"] = LINTS_SKIPPED
    report["gate_inputs"]["ane_lint"] = {"skipped": ""}
    with pytest.raises(ReportError, match=r"gate_inputs\.ane_lint\.skipped"):
        validate_report(report)
