"""Speculative-decoding gates: greedy output identical to the worker alone; speedup and acceptance gated.

The speedup is decided from TPS samples per speed worker process (the pipeline's speed step measures plain and
speculative decoding interleaved in each of ``speed.speculative_workers`` fresh processes): pass when its interval
shows it at least ``speculative_speedup_min``, fail when it shows it below, else inconclusive (fails under CI,
skips locally, like the speed gates).
"""

from __future__ import annotations

import pytest


@pytest.mark.speculative
def test_identical_output(gate, report):
    gate.equals("speculative.identical", report.get("gate_inputs.speculative.identical"), True,
                "greedy output with the drafter equals the worker's own greedy output")


@pytest.mark.speculative
def test_speculative_speedup(gate, report, thresholds):
    gate.speedup_at_least("speculative.speedup", report.get("gate_inputs.speculative.tps_plain"),
                          report.get("gate_inputs.speculative.tps_speculative"), thresholds.speculative_speedup_min,
                          alpha=thresholds.significance_alpha,
                          definition="TPS p50 speculative / plain per speed worker process, t interval over processes")


@pytest.mark.speculative
def test_speculative_acceptance(gate, report, thresholds):
    gate.at_least("speculative.acceptance_rate", report.get("gate_inputs.speculative.acceptance_rate"),
                  thresholds.speculative_acceptance_min, "accepted / proposed drafter tokens")
