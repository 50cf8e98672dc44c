"""QAT gates: probe outputs (attention/MLP) before vs after QAT stay aligned, and nothing is NaN."""

from __future__ import annotations

import math
from typing import Any

import pytest


def probe(report) -> dict[str, Any]:
    """The run's QAT probe; a run trained without QAT has none, and these gates do not apply to it."""
    if "qat" not in report.get("gate_inputs"):
        if not report.header.get("config", {}).get("train", {}).get("qat", {}).get("enabled", True):
            pytest.skip("QAT is off in this run (train.qat.enabled: false): no probe to gate")
        report.get("gate_inputs.qat")  # QAT on but no probe: fails naming the report and the key
    return report.get("gate_inputs.qat")


@pytest.mark.qat_cosine
def test_probe_cosine_min(gate, report, thresholds):
    qat = probe(report)
    gate.at_least("qat.probe_cosine_min", qat["probe_cosine_min"], thresholds.qat_cosine_min,
                  "minimum over probed modules of cosine(pre-QAT output, post-QAT output)")


@pytest.mark.qat_cosine
def test_probe_cosine_every_module(gate, report, thresholds):
    qat = probe(report)
    per_module = qat["probe_cosine"]
    gate.at_least("qat.probe_modules", len(per_module), 1, "number of probed modules")
    for module, cosine in sorted(per_module.items()):
        gate.at_least(f"qat.probe_cosine[{module}]", cosine, thresholds.qat_cosine_min, "probe cosine of one module")


@pytest.mark.qat_cosine
def test_no_nan(gate, report):
    qat = probe(report)
    has_nan = qat.get("has_nan") or any(math.isnan(c) for c in qat["probe_cosine"].values())
    gate.equals("qat.has_nan", has_nan, False, "no NaN in QAT weights or probe outputs")
