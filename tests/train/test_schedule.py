"""The one learning-rate schedule: warmup then cosine, shared by the student recipe and the toy teacher."""

from __future__ import annotations

import itertools
import math

from distillgates.config import QATConfig, TrainConfig
from distillgates.train.recipe import lr_lambda
from distillgates.train.schedule import warmup_cosine


def test_warms_up_then_decays_to_the_floor() -> None:
    lrs = [warmup_cosine(s, peak=2.0, warmup_steps=10, total_steps=100, min_lr_ratio=0.1) for s in range(120)]
    assert lrs[0] == 0.2 and lrs[9] == 2.0 and max(lrs) == 2.0
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert abs(lrs[99] - 0.2) < 0.01 and lrs[100:] == [0.2] * 20  # held at min_lr_ratio * peak after the end


def test_warmup_matches_the_toy_teachers_original_arithmetic() -> None:
    """``peak * (step + 1) / warmup``, left to right: the toy teacher's learning rates are bit-identical."""
    lr, warmup, total, floor = 3e-3, 30, 600, 0.1
    for step in range(total):
        if step < warmup:
            expected = lr * (step + 1) / warmup
        else:
            progress = (step - warmup) / (total - warmup)
            expected = lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert warmup_cosine(step, peak=lr, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor) == expected


def test_recipe_factor_is_the_schedule_times_the_qat_scale() -> None:
    cfg = TrainConfig(steps=40, warmup_steps=4, min_lr_ratio=0.2,
                      qat=QATConfig(enabled=True, start_fraction=0.5, lr_scale=0.1))  # fmt: skip
    factor = lr_lambda(cfg)
    for step in range(40):
        base = warmup_cosine(step, peak=1.0, warmup_steps=4, total_steps=40, min_lr_ratio=0.2)
        assert factor(step) == (base * 0.1 if step >= 20 else base)
