"""Enumerated-shape sampler: every batch has exactly one of the shapes the export enumerates.

Design choices:
- Bucketing: an item goes to the smallest enumerated shape that holds it; a batch is drawn from one
  bucket and padded to that shape with ``<|pad|>`` plus an attention mask, so training sees exactly
  the sequence lengths Core ML will be asked to run (no shape drift between train and deploy).
- Dirichlet schedule: at step ``t`` the shape probabilities are a draw
  ``p_t ~ Dirichlet(c_t * base_t)`` where ``base_t`` moves from uniform to the production mix and
  ``c_t`` grows from ``concentration_start`` to ``concentration_end`` over ``anneal_fraction`` of
  training: early batches cover all shapes, late ones follow production traffic.
- Rare-shape up-weighting: every ``rare_every`` steps the probabilities are replaced by weights
  proportional to ``1 / mix`` so rare long shapes keep being trained.
- Deterministic and resumable: everything at step ``t`` comes from ``numpy.random.default_rng
  ([seed, t])``, so the sampler state is just ``(seed, step)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from distillgates.config import ShapesConfig
from distillgates.data.chat import chat_format


def bucket_of(length: int, lengths: Sequence[int]) -> int | None:
    """The smallest enumerated shape that holds ``length`` tokens; ``None`` if none does."""
    return next((shape for shape in lengths if length <= shape), None)


@dataclass
class ShapeBatch:
    """Indices of the items of one batch and the single shape they are padded to."""

    step: int
    shape: int
    indices: list[int]
    rare_step: bool  # the probabilities of this step were up-weighted toward rare shapes


class ShapeSampler:
    """Draws, per training step, one enumerated shape and a batch of items that fit it.

    Args:
        item_lengths: token length of each item (e.g. of the rendered conversation).
        cfg: shapes and production mix plus the schedule knobs.
        batch_size: items per batch.
        total_steps: training length (sets the annealing horizon).
        seed: sampler seed.
        step: first step (resume from a saved :meth:`state_dict`).

    Raises:
        ValueError: if no item fits any enumerated shape.
    """

    def __init__(
        self,
        item_lengths: Sequence[int],
        cfg: ShapesConfig,
        batch_size: int,
        total_steps: int,
        seed: int = 0,
        step: int = 0,
    ) -> None:
        self.cfg, self.batch_size, self.total_steps = cfg, batch_size, total_steps
        self.seed, self.step = seed, step
        self.buckets: dict[int, list[int]] = {shape: [] for shape in cfg.lengths}
        self.overflow: list[int] = []  # items longer than the largest shape: never sampled
        for index, length in enumerate(item_lengths):
            shape = bucket_of(length, cfg.lengths)
            (self.buckets[shape] if shape else self.overflow).append(index)
        self._available = np.array([bool(self.buckets[s]) for s in cfg.lengths])
        if not self._available.any():
            raise ValueError(f"no item fits any enumerated shape {cfg.lengths} (max length {max(item_lengths)})")

    def _progress(self, step: int) -> float:
        return min(1.0, step / max(1.0, self.cfg.anneal_fraction * self.total_steps))

    def is_rare_step(self, step: int) -> bool:
        return self.cfg.rare_every > 0 and step > 0 and step % self.cfg.rare_every == 0

    def expected_probabilities(self, step: int) -> np.ndarray:
        """Mean of the step's Dirichlet (before the draw and the rare up-weighting): ``base_t``."""
        mix = np.asarray(self.cfg.mix, dtype=np.float64)
        uniform = np.full_like(mix, 1.0 / len(mix))
        lam = self._progress(step)
        return (1.0 - lam) * uniform + lam * mix

    def probabilities(self, step: int) -> np.ndarray:
        """The shape probabilities used at ``step`` (deterministic in ``(seed, step)``)."""
        rng = np.random.default_rng([self.seed, step])
        if self.is_rare_step(step):
            mix = np.asarray(self.cfg.mix, dtype=np.float64)
            probs = np.where(mix > 0, 1.0 / np.maximum(mix, 1e-12), 0.0)
        else:
            lam = self._progress(step)
            concentration = self.cfg.concentration_start + lam * (
                self.cfg.concentration_end - self.cfg.concentration_start
            )
            alpha = np.maximum(concentration * self.expected_probabilities(step), 1e-3)
            probs = rng.dirichlet(alpha)
        probs = probs * self._available  # empty buckets cannot be drawn
        if probs.sum() <= 0:  # the draw put all mass on empty buckets
            probs = self._available.astype(np.float64)
        return probs / probs.sum()

    def batch_at(self, step: int) -> ShapeBatch:
        """The batch of ``step``: one shape, ``batch_size`` item indices from its bucket."""
        rng = np.random.default_rng([self.seed, step, 1])
        shape = int(rng.choice(self.cfg.lengths, p=self.probabilities(step)))
        bucket = self.buckets[shape]
        replace = len(bucket) < self.batch_size
        picks = rng.choice(len(bucket), size=self.batch_size, replace=replace)
        return ShapeBatch(step, shape, [bucket[i] for i in picks], self.is_rare_step(step))

    def __iter__(self) -> Iterator[ShapeBatch]:
        return self

    def __next__(self) -> ShapeBatch:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])


def pad_rows(
    rows: Sequence[Sequence[Any]], shape: int, pad_value: Any, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Right-pad each row to ``shape`` -> ``(B, shape)``.

    Raises:
        ValueError: if a row is longer than ``shape``.
    """
    out = torch.full((len(rows), shape), pad_value, dtype=dtype)  # (B, S)
    for i, row in enumerate(rows):
        if len(row) > shape:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the shape {shape}")
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


def collate(rows: Sequence[Sequence[int]], shape: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Token rows -> ``input_ids (B, shape)`` padded with ``pad_id`` and ``attention_mask (B, shape)`` (bool)."""
    input_ids = pad_rows(rows, shape, pad_id)  # (B, S)
    attention_mask = pad_rows([[True] * len(r) for r in rows], shape, False, torch.bool)  # (B, S)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def eval_slices(
    items: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerFast, lengths: Sequence[int]
) -> dict[int, list[str]]:
    """Per-shape eval slices: ``{shape: [item ids]}`` by the bucket of the rendered conversation.

    Items longer than the largest shape belong to no slice.
    """
    slices: dict[int, list[str]] = {shape: [] for shape in lengths}
    fmt = chat_format(tokenizer)
    for item in items:
        shape = bucket_of(len(fmt.encode(fmt.conversation(item))), lengths)
        if shape is not None:
            slices[shape].append(item["id"])
    return slices
