"""Enumerated-shape sampler: one shape per batch, schedule toward the production mix, rare-shape
up-weighting, determinism and resume, padding, per-shape eval slices."""

from __future__ import annotations

import numpy as np
import pytest

from distillgates.config import ShapesConfig
from distillgates.data.chat import render_conversation
from distillgates.data.shapes import ShapeSampler, bucket_of, collate, eval_slices
from distillgates.tokenizer import encode

CFG = ShapesConfig(lengths=[128, 192, 256], mix=[0.5, 0.35, 0.15], rare_every=10)
LENGTHS = [100] * 50 + [150] * 50 + [250] * 50 + [300] * 3  # the last three fit no shape
STEPS = 2000


def _sampler(**kwargs):
    return ShapeSampler(LENGTHS, CFG, batch_size=4, total_steps=STEPS, **kwargs)


def test_bucket_of_picks_the_smallest_shape_that_fits():
    assert [bucket_of(n, CFG.lengths) for n in (1, 128, 129, 192, 256, 257)] == [128, 128, 192, 192, 256, None]


def test_every_batch_has_exactly_one_shape_from_its_bucket():
    sampler = _sampler()
    assert sampler.overflow == [150, 151, 152]
    for batch in (next(sampler) for _ in range(200)):
        assert batch.shape in CFG.lengths and len(batch.indices) == 4
        assert all(bucket_of(LENGTHS[i], CFG.lengths) == batch.shape for i in batch.indices)
        rows = [[5] * LENGTHS[i] for i in batch.indices]
        out = collate(rows, batch.shape, pad_id=2)
        assert out["input_ids"].shape == (4, batch.shape) and out["attention_mask"].shape == (4, batch.shape)


def test_schedule_starts_broad_and_converges_to_the_production_mix():
    sampler = _sampler()
    assert np.allclose(sampler.expected_probabilities(0), [1 / 3] * 3)
    late = [s for s in range(STEPS // 2, STEPS) if not sampler.is_rare_step(s)]
    assert np.allclose(sampler.expected_probabilities(late[0]), CFG.mix)
    mean_probs = np.mean([sampler.probabilities(s) for s in late], axis=0)
    assert np.allclose(mean_probs, CFG.mix, atol=0.02)
    shapes = [sampler.batch_at(s).shape for s in late]
    freq = [shapes.count(shape) / len(shapes) for shape in CFG.lengths]
    assert np.allclose(freq, CFG.mix, atol=0.04)
    # early draws are noisier (low concentration) than late ones
    early_spread = np.std([sampler.probabilities(s) for s in range(1, 100) if not sampler.is_rare_step(s)], axis=0)
    late_spread = np.std([sampler.probabilities(s) for s in late], axis=0)
    assert (early_spread > late_spread).all()


def test_rare_shapes_are_up_weighted_every_n_steps():
    sampler = _sampler()
    rare_steps = [s for s in range(1, STEPS) if sampler.is_rare_step(s)]
    assert rare_steps[:3] == [10, 20, 30]
    assert all(sampler.batch_at(s).rare_step for s in rare_steps[:5])
    assert sampler.probabilities(10)[2] > 0.5  # 1/mix weights: 256 is the rarest shape
    shapes = [sampler.batch_at(s).shape for s in rare_steps]
    assert shapes.count(256) / len(shapes) > 0.4 > CFG.mix[2]


def test_deterministic_and_resumable():
    a = [next(s) for s in [_sampler(seed=3)] for _ in range(40)]
    assert a == [next(s) for s in [_sampler(seed=3)] for _ in range(40)]
    assert a != [next(s) for s in [_sampler(seed=4)] for _ in range(40)]
    first = _sampler(seed=3)
    [next(first) for _ in range(15)]
    state = first.state_dict()
    assert state == {"seed": 3, "step": 15}
    resumed = _sampler()
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(25)] == a[15:]


def test_empty_buckets_are_never_drawn():
    sampler = ShapeSampler([10, 20, 30], CFG, batch_size=8, total_steps=100)
    assert {sampler.batch_at(s).shape for s in range(100)} == {128}
    with pytest.raises(ValueError, match="no item fits"):
        ShapeSampler([999], CFG, batch_size=2, total_steps=10)


def test_collate_pads_and_masks():
    out = collate([[7, 8, 9], [7]], 5, pad_id=2)
    assert out["input_ids"].tolist() == [[7, 8, 9, 2, 2], [7, 2, 2, 2, 2]]
    assert out["attention_mask"].tolist() == [[True] * 3 + [False] * 2, [True] + [False] * 4]
    with pytest.raises(ValueError, match="more than the shape"):
        collate([[1] * 6], 5, pad_id=2)


def test_eval_slices_partition_items_by_smallest_shape(toy_items, toy_tokenizer):
    items = toy_items[:120]
    slices = eval_slices(items, toy_tokenizer, CFG.lengths)
    ids = [i for shape in CFG.lengths for i in slices[shape]]
    lengths = {item["id"]: len(encode(toy_tokenizer, render_conversation(item))) for item in items}
    assert sorted(ids) == sorted(i for i, n in lengths.items() if n <= 256)
    for shape, members in slices.items():
        assert all(bucket_of(lengths[i], CFG.lengths) == shape for i in members)
    assert all(slices[shape] for shape in CFG.lengths)  # the toy data fills every shape
