"""The learning-rate schedule of every optimizer here (student, drafter, toy teacher)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * peak`` at
    ``total_steps`` (held there after it).

    ``peak=1.0`` gives the multiplier a ``LambdaLR`` wants.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
