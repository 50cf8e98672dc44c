"""Speed gates (run only with ``-m speed``): TTFT p50/p95 and TPS p50/p5 vs the blessed reference of the profile.

Default (``--speed-mode=ab``): the blessed code on the blessed artifacts and the current code on the current
artifacts, measured in alternating rounds in this session (distillgates.gates.speed_ab). A gate fails only
when the quantile's regression exceeds the profile's threshold *and* is significant, with the false-alarm
rate split over these four gates and the rounds of the sequential test (distillgates.gates.stats).
"""

from __future__ import annotations

import pytest

# (metric, statistic, quantile, higher is better): the median and the slow tail of each metric
GATES = [("ttft_ms", "p50", 0.50, False), ("ttft_ms", "p95", 0.95, False), ("tps", "p50", 0.50, True),
         ("tps", "p5", 0.05, True)]


@pytest.mark.speed
@pytest.mark.parametrize(("metric", "stat", "quantile", "higher_is_better"), GATES,
                         ids=[f"{m}-{s}" for m, s, _, _ in GATES])
def test_speed_no_regression(gate, speed_policy, speed_rounds, thresholds, metric, stat, quantile, higher_is_better):
    gate.speed_no_regression(
        f"{metric}.{stat}", speed_rounds, metric, threshold=speed_policy.max_regression, quantile=quantile,
        higher_is_better=higher_is_better, alpha=thresholds.significance_alpha, n_gates=len(GATES),
        definition=f"{stat} of {metric} at batch 1 (speed worker: Core ML on macOS, else PyTorch), raw samples",
    )
