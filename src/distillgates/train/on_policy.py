"""On-policy distillation (``train.on_policy``): the student's own conversations as training rows.

On a share of the steps (:func:`on_policy_step`: a pure function of seed and step, so a resumed run samples
where an uninterrupted one does) the student plays each conversation of its batch from the prompt, as the
eval plays it: the item's tools in the system prompt, every call validated and answered by the item's
fixtures (:func:`distillgates.eval.runners.run_item`), at most ``max_turns`` calls. It samples at
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

from distillgates.config import OnPolicyConfig
from distillgates.eval.runners import EngineSession, run_item
from distillgates.model import Transformer
from distillgates.train.data import Row, shape_for


def on_policy_step(seed: int, step: int, share: float) -> bool:
    """Whether step ``step`` trains on the student's samples (drawn once per (seed, step))."""
    if share <= 0.0:
        return False
    return share >= 1.0 or random.Random(f"on-policy:{seed}:{step}").random() < share


def sample_seed(seed: int, step: int, item_id: str) -> int:
    """The sampler seed of one item at one step (turn ``t`` samples with this + ``t``)."""
    digest = hashlib.sha256(f"{seed}:{step}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class SamplingSession(EngineSession):
    """:class:`~distillgates.eval.runners.EngineSession` sampling at the config's temperature, one seed per turn;
    :meth:`ids` is the conversation's token sequence (the engine's state and its pending stop token)."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: OnPolicyConfig, seed: int) -> None:
        super().__init__(engine, tokenizer, cfg.max_new_tokens)
        self.cfg, self.seed, self.turn_index = cfg, seed, 0
        self.prompt_len = 0
        self.generated: list[tuple[int, int]] = []  # (first prediction position, tokens) of each sampled turn

    def _decode(self) -> dict[str, Any]:
        self.turn_index += 1
        return {"stop_ids": self.stop_ids, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p,
                "seed": self.seed + self.turn_index}  # fmt: skip

    def first_turn(self, item: Any, prompt_text: str) -> Any:
        self.prompt_len = len(self.encode(prompt_text))
        return super().first_turn(item, prompt_text)

    def turn(self, ids: Sequence[int]) -> Any:
        self.generated.append((len(self.ids()) - len(ids) - 1, len(ids)))  # the turn's tokens end the sequence
        return super().turn(ids)

    def ids(self) -> list[int]:
        pending = [self.engine.pending] if self.engine.pending is not None else []
        return [*self.engine.tokens, *pending]


@torch.no_grad()
def sample_rows(
    model: Transformer, tokenizer: Any, rows: Sequence[Row], cfg: OnPolicyConfig, seed: int, step: int,
    lengths: Sequence[int],
) -> tuple[list[Row], list[dict[str, Any]]]:  # fmt: skip
    """The student's sampled conversation of each row's item, as a training row, and the eval outputs of them.

    A sampled row keeps its item's length target and tool-call prefix (``teacher_len``, ``early``); it has no
    process spans, no answer-evidence position and no top-k KD (the teacher scores it densely).
    """
    from distillgates.runtime.torch_engine import TorchEngine

    engine = TorchEngine(copy.deepcopy(model).float())  # the step's weights; the training model keeps no cache
    sampled, outputs = [], []
    for row in rows:
        session = SamplingSession(engine, tokenizer, cfg, sample_seed(seed, step, str(row.item["id"])))
        outputs.append(run_item(row.item, session, max_calls=cfg.max_turns))
        full = session.ids()
        sampled.append(Row(item=row.item, ids=full[: lengths[-1]], prompt_len=session.prompt_len,
                           shape=shape_for(len(full), lengths), process=[], teacher_len=row.teacher_len,
                           length=len(full), early=list(row.early), generated=session.generated))  # fmt: skip
    return sampled, outputs


__all__ = ["SamplingSession", "on_policy_step", "sample_rows", "sample_seed"]
