"""Batch policy: interactive requests run at batch 1; offline work batches 2-4 only when it pays.

"Pays" is measured, never assumed: batching raises throughput only while decode is bound by
weight reads, and it always lengthens each step. A batch size is chosen for offline work only if
its tokens/s beat batch 1 by at least ``min_tps_gain`` AND its p95 step latency is less than
``max_p95_penalty`` worse than batch 1's. :func:`decide_batch_size` is pure (testable with given
numbers); :func:`measure_batches` produces the numbers with a :class:`TorchEngine`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from distillgates.runtime.torch_engine import TorchEngine


@dataclass(frozen=True)
class BatchMeasurement:
    tps: float  # generated tokens per second over all rows
    p95_step_ms: float  # p95 latency of one decode step (what each user waits per token)


def decide_batch_size(
    measurements: dict[int, BatchMeasurement],
    mode: str,
    *,
    min_tps_gain: float = 0.10,
    max_p95_penalty: float = 0.10,
    allowed: Sequence[int] = (2, 3, 4),
) -> int:
    """Batch size to use.

    Args:
        measurements: batch size -> measurement; must contain batch 1 for offline mode.
        mode: ``"interactive"`` (always 1) or ``"offline"``.
        allowed: batch sizes above 1 that may be chosen (e.g. from the hardware profile).

    Returns:
        1 unless a batch size in ``allowed`` improves TPS by >= ``min_tps_gain`` with a p95 step
        latency penalty < ``max_p95_penalty``; among those, the one with the highest TPS.
    """
    if mode not in ("interactive", "offline"):
        raise ValueError(f"mode must be 'interactive' or 'offline', got {mode!r}")
    if mode == "interactive":
        return 1
    if 1 not in measurements:
        raise ValueError(f"offline decision needs a batch-1 measurement, got batch sizes {sorted(measurements)}")
    base = measurements[1]
    best, best_tps = 1, base.tps
    for size, m in sorted(measurements.items()):
        if size == 1 or size not in allowed:
            continue
        gain = m.tps / base.tps - 1.0
        penalty = m.p95_step_ms / base.p95_step_ms - 1.0
        if gain >= min_tps_gain and penalty < max_p95_penalty and m.tps > best_tps:
            best, best_tps = size, m.tps
    return best


def measure_batches(
    engine: TorchEngine, prompts: Sequence[Sequence[int]], sizes: Sequence[int] = (1, 2, 3, 4), new_tokens: int = 32
) -> dict[int, BatchMeasurement]:
    """Decode ``new_tokens`` greedy steps for batches of the first ``size`` prompts; one warm-up each."""
    out: dict[int, BatchMeasurement] = {}
    for size in sizes:
        if size > engine.max_batch_size or size > len(prompts):
            raise ValueError(f"batch {size} needs max_batch_size and prompts >= {size}")
        batch = list(prompts[:size])
        step_ms: list[float] = []
        for _ in range(2):  # the first pass is a warm-up
            step_ms = []
            logits = engine.prefill_batch(batch)
            start = time.perf_counter()
            for _ in range(new_tokens):
                t0 = time.perf_counter()
                logits = engine.decode_batch(logits.argmax(-1).tolist())
                step_ms.append((time.perf_counter() - t0) * 1e3)
            elapsed = time.perf_counter() - start
        out[size] = BatchMeasurement(tps=size * new_tokens / elapsed, p95_step_ms=float(np.percentile(step_ms, 95)))
    return out
