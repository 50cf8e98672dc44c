from __future__ import annotations

import pytest

from distillgates.runtime.batch_policy import BatchMeasurement, decide_batch_size, measure_batches
from distillgates.runtime.torch_engine import TorchEngine

BASE = BatchMeasurement(tps=100.0, p95_step_ms=10.0)


def test_interactive_is_always_batch_one():
    assert decide_batch_size({1: BASE, 4: BatchMeasurement(400.0, 10.0)}, "interactive") == 1


@pytest.mark.parametrize(
    ("measured", "expected"),
    [
        ({2: BatchMeasurement(110.0, 10.9)}, 2),  # +10% TPS, +9% p95: both limits met
        ({2: BatchMeasurement(109.9, 10.0)}, 1),  # TPS gain just below 10%
        ({2: BatchMeasurement(150.0, 11.0)}, 1),  # p95 penalty of exactly 10% is not < 10%
        ({2: BatchMeasurement(120.0, 10.5), 4: BatchMeasurement(160.0, 10.8)}, 4),  # best qualifying TPS
        ({2: BatchMeasurement(120.0, 10.5), 4: BatchMeasurement(160.0, 14.0)}, 2),  # 4 too slow per step
        ({8: BatchMeasurement(500.0, 10.0)}, 1),  # not an allowed size
    ],
)
def test_offline_needs_tps_gain_and_small_p95_penalty(measured, expected):
    assert decide_batch_size({1: BASE, **measured}, "offline") == expected


def test_bad_inputs():
    with pytest.raises(ValueError, match="batch-1"):
        decide_batch_size({2: BASE}, "offline")
    with pytest.raises(ValueError, match="mode"):
        decide_batch_size({1: BASE}, "server")


def test_measure_batches_feeds_the_decision(make_model):
    engine = TorchEngine(make_model(0), max_batch_size=2)
    measured = measure_batches(engine, [[1, 2, 3], [4, 5, 6, 7]], sizes=(1, 2), new_tokens=4)
    assert set(measured) == {1, 2} and all(m.tps > 0 and m.p95_step_ms > 0 for m in measured.values())
    assert decide_batch_size(measured, "offline") in (1, 2)
