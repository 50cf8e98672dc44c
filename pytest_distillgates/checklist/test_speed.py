"""Speed gates (run only with ``-m speed``): live TTFT/TPS vs the same-profile baseline.

A TTFT/TPS gate fails only when the regression exceeds the threshold *and* is significant on
the raw samples (see distillgates.gates.stats); ``--speed-paired`` measures the blessed
reference model interleaved with the candidate instead of using the stored samples.
"""

from __future__ import annotations

import pytest

METRICS = [("ttft_ms", False), ("tps", True)]  # (speed metric, higher is better)
STATS = {"p50": 0.5, "p95": 0.95}


@pytest.mark.speed
@pytest.mark.parametrize("stat", list(STATS))
@pytest.mark.parametrize(("metric", "higher_is_better"), METRICS, ids=[m for m, _ in METRICS])
def test_speed_no_regression(gate, speed_policy, speed_measure, speed_reference, reference_model_provenance,
                             thresholds, metric, higher_is_better, stat):
    gate.speed_no_regression(
        f"{metric}.{stat}", speed_measure(metric), f"{metric}.{stat}", threshold=speed_policy.max_regression,
        higher_is_better=higher_is_better, quantile=STATS[stat], alpha=thresholds.significance_alpha,
        definition=f"{stat} of {metric} at batch 1 (speed harness; Core ML on macOS, else PyTorch), raw samples",
        measure_reference=lambda entry: speed_reference(entry)(metric), bless_extra=reference_model_provenance,
    )
