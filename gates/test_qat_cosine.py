"""QAT gates: probe outputs (attention/MLP) before vs after QAT stay aligned, and nothing is NaN."""

from __future__ import annotations

import math

import pytest


@pytest.mark.qat_cosine
def test_probe_cosine_min(gate, report, thresholds):
    gate.at_least("qat.probe_cosine_min", report.get("gate_inputs.qat.probe_cosine_min"), thresholds.qat_cosine_min,
                  "minimum over probed modules of cosine(pre-QAT output, post-QAT output)")


@pytest.mark.qat_cosine
def test_probe_cosine_every_module(gate, report, thresholds):
    per_module = report.get("gate_inputs.qat.probe_cosine")
    gate.at_least("qat.probe_modules", len(per_module), 1, "number of probed modules")
    for module, cosine in sorted(per_module.items()):
        gate.at_least(f"qat.probe_cosine[{module}]", cosine, thresholds.qat_cosine_min, "probe cosine of one module")


@pytest.mark.qat_cosine
def test_no_nan(gate, report):
    cosines = report.get("gate_inputs.qat.probe_cosine").values()
    has_nan = report.get("gate_inputs.qat.has_nan") or any(math.isnan(c) for c in cosines)
    gate.equals("qat.has_nan", has_nan, False, "no NaN in QAT weights or probe outputs")
