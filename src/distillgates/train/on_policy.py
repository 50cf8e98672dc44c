"""On-policy distillation (``train.on_policy``): the student's own conversations as training rows.

On a share of the steps (:func:`on_policy_step`: a pure function of seed and step, so a resumed run samples
where an uninterrupted one does; none before ``start_fraction`` of the steps, an off-policy phase first) the
student plays each conversation of its batch from the prompt, as the eval plays it: the item's tools in the
system prompt, every call validated and answered by the item's fixtures, at most ``max_turns`` calls; the
batch's conversations are decoded together
(:func:`distillgates.eval.runners.play_batched`, the batched eval's loop). It samples at
``temperature``/``top_p`` with a seed drawn from (seed, step, item, turn), on the PyTorch engine over a
copy of the weights of that step (during late QAT: the float weights the QAT graph fake-quantizes). The row
is exactly the token sequence the student saw: the prompt, its turns with their stop tokens, and the tool
results between them, with the positions of each sampled turn (its loss mask: a turn the budget cut or
another stop id ended counts too).

The recipe scores the row with the teacher's dense logits (one forward) and trains the student's turn
positions on the generalized JSD (:func:`distillgates.losses.divergence`, ``beta``). There is no CE on a
sampled row (no reference for the student's own tokens). The latency losses read the same row: the length
loss penalises the student's own turns against the item's target length (exempt when its own sample covers
the required arguments and evidence), and the early-tool CE applies while the sample's prefix agrees with
the tool-call target (:func:`distillgates.losses.early_tool_positions`).
"""

from __future__ import annotations

import copy
import hashlib
import random
from collections.abc import Sequence
from typing import Any

import torch

from distillgates.config import OnPolicyConfig, TrainConfig
from distillgates.eval.runners import play_batched
from distillgates.model import Transformer
from distillgates.runtime.base import make_generator, sample_token
from distillgates.train.data import Row, shape_for


def on_policy_step(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` trains on the student's samples: drawn once per (seed, step) with probability
    ``on_policy.share``, from step ``int(on_policy.start_fraction * steps)`` on (before it: the off-policy phase)."""
    share = cfg.on_policy.share
    if share <= 0.0 or step < int(cfg.on_policy.start_fraction * cfg.steps):
        return False
    return share >= 1.0 or random.Random(f"on-policy:{cfg.seed}:{step}").random() < share


def sample_seed(seed: int, step: int, item_id: str) -> int:
    """The sampler seed of one item at one step (turn ``t`` samples with this + ``t``)."""
    digest = hashlib.sha256(f"{seed}:{step}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@torch.no_grad()
def sample_rows(
    model: Transformer, tokenizer: Any, rows: Sequence[Row], cfg: OnPolicyConfig, seed: int, step: int,
    lengths: Sequence[int],
) -> tuple[list[Row], list[dict[str, Any]]]:  # fmt: skip
    """The student's sampled conversation of each row's item, as a training row, and the eval outputs of them.

    The batch's conversations are played together (:func:`~distillgates.eval.runners.play_batched`: one cache row
    each, a forward per token over the rows still open), each turn sampled with its own generator, seeded by
    :func:`sample_seed` + the turn's number. A sampled row keeps its item's length target and tool-call prefix
    (``teacher_len``, ``early``); it has no process spans, no answer-evidence position and no top-k KD (the
    teacher scores it densely).
    """
    from distillgates.runtime.torch_engine import TorchEngine

    # the step's weights on their own static cache; the training model keeps none
    engine = TorchEngine(copy.deepcopy(model).float(), max_batch_size=len(rows))
    seeds = [sample_seed(seed, step, str(row.item["id"])) for row in rows]
    generators: dict[tuple[int, int], torch.Generator] = {}

    def pick(index: int, turn: int, logits: torch.Tensor) -> int:
        if (index, turn) not in generators:
            generators[(index, turn)] = make_generator(seeds[index] + turn)
        return sample_token(logits, cfg.temperature, cfg.top_p, generators[(index, turn)])

    played = play_batched(engine, tokenizer, [row.item for row in rows], len(rows), cfg.max_new_tokens,
                          max_calls=cfg.max_turns, pick=pick)  # fmt: skip
    sampled = [Row(item=row.item, ids=p.ids[: lengths[-1]], prompt_len=p.prompt_len,
                   shape=shape_for(len(p.ids), lengths), process=[], teacher_len=row.teacher_len, length=len(p.ids),
                   early=list(row.early), generated=p.generated)
               for row, p in zip(rows, played, strict=True)]  # fmt: skip
    return sampled, [p.output for p in played]


__all__ = ["on_policy_step", "sample_rows", "sample_seed"]
