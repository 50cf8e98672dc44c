"""Export gates: the exported program matches eager per shape (with ``export.target: coreai``, the asset run by Core
AI's runtime); no int64 on attention; contract OK;
the ANE op-eligibility lint is clean (no ineligible op on the attention/MLP path, shapes within the ANE's limits);
every activation stays inside fp16's range (the ANE computes fp16)."""

from __future__ import annotations

from typing import Any

import pytest

from distillgates.export.functions import COREAI_SOURCE


def shipped(report) -> str:
    """What the export gates' cosines ran: the exported programs with the saved package's weights, or with
    ``export.target: coreai`` the asset itself, run by Core AI's runtime."""
    source = report.get("gate_inputs.export").get("source")
    if source == COREAI_SOURCE:
        return COREAI_SOURCE.split(" vs ")[0]
    return "exported program run with the weights read back from the saved .mlpackage"


@pytest.mark.export
def test_export_cosine(gate, report, thresholds, shape):
    cosine = report.get("gate_inputs.export.cosine_by_shape").get(shape, float("nan"))
    gate.at_least(f"export.cosine[shape={shape}]", cosine, thresholds.export_cosine_min,
                  f"cosine({shipped(report)}, eager logits); NaN when the shape was not exported")


@pytest.mark.export
def test_export_decode_cosine(gate, report, thresholds):
    decode = report.get("gate_inputs.export.decode_cosine")
    gate.at_least("export.decode_cosine_min", min(decode, default=float("nan")), thresholds.export_cosine_min,
                  f"lowest cosine over the decode steps (stateful decode: {shipped(report)}, vs eager); NaN when no "
                  "decode step was compared")


def ane_lint(report) -> dict[str, Any]:
    lint = report.get("gate_inputs.ane_lint")
    if "skipped" in lint:
        pytest.skip(f"no ANE op lint: {lint['skipped']}")
    return lint  # type: ignore[no-any-return]


def lints(report) -> dict[str, Any]:
    export = report.get("gate_inputs.export")
    if "lints_skipped" in export:
        pytest.skip(export["lints_skipped"])
    return export  # type: ignore[no-any-return]


@pytest.mark.export
def test_no_int64_on_attention(gate, report):
    gate.equals("export.int64_on_attention", lints(report)["int64_on_attention"], [],
                "int64 tensors on attention paths (the ANE has no int64)")


@pytest.mark.export
def test_lint_clean(gate, report):
    gate.equals("export.lint_errors", lints(report)["lint_errors"], [], "ANE lint errors")


@pytest.mark.export
def test_contract(gate, report):
    gate.equals("export.contract_ok", report.get("gate_inputs.export.contract_ok"), True,
                "export/contract.json matches the exported models (names, shapes, dtypes, states)")


@pytest.mark.export
def test_ane_ops_eligible(gate, report):
    lint = ane_lint(report)
    gate.equals(f"ane.ineligible_ops[{lint['source']}]", lint["ineligible_ops"], [],
                "ops on the attention/MLP path (reading activations) the ANE does not run: op type off the ANE "
                "list, or a fp32/int output (the ANE computes fp16); a static check, not a residency measurement")


@pytest.mark.export
def test_ane_within_limits(gate, report):
    lint = ane_lint(report)
    limits = lint["limits"]
    gate.equals(f"ane.over_limits[{lint['source']}]", lint["over_limits"], [],
                f"ops on the attention/MLP path with an output above the ANE's limits (rank <= {limits['max_rank']}, "
                f"every dimension <= {limits['max_dim']}; split a larger LM head)")


@pytest.mark.export
def test_fp16_headroom(gate, report):
    headroom = report.get("gate_inputs").get("fp16_headroom")
    if headroom is None:
        pytest.skip("no fp16 headroom figure: the run was exported before the scan (run `distillgates run` again)")
    if "skipped" in headroom:
        pytest.skip(f"no fp16 headroom figure: {headroom['skipped']}")
    gate.at_most("export.fp16_max_activation", headroom.get("max_peak"), headroom.get("limit"),
                 f"largest |activation| of any layer ({headroom.get('worst')}: margin x{headroom.get('margin', 0):.1f} "
                 f"to fp16's 65504) over {headroom.get('rows')} calibration rows, {headroom.get('source')}; layers "
                 f"over: {headroom.get('over') or 'none'}")
