"""Greedy speculative decoding: a drafter proposes k tokens, the worker verifies them in one forward.

Design choices:
- Both models run on :class:`TorchEngine` static caches; a rejected draft is rolled back by moving
  the position (stale slots are masked by causality), so rollback costs nothing.
- Verification writes ``[last, d1..dk]`` at positions ``p..p+k`` in ONE worker forward; row ``i``
  is the worker's greedy choice after ``d_i``. The longest prefix with ``d_{i+1} == argmax(row i)``
  is accepted, plus the worker's own token at the first mismatch (or the bonus token after
  ``dk``). Every emitted token is therefore the worker's greedy choice: the output is the
  worker's greedy output (bit-identical in exact arithmetic; tested in float64).
- Adaptive k: all k accepted -> k + 1; fewer than half accepted -> k - 1, within [k_min, k_max].

Reference: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
(greedy case).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from distillgates.runtime.torch_engine import TorchEngine


@dataclass
class SpeculativeStats:
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    worker_steps: int = 0  # worker verification forwards (prefill excluded)
    rollbacks: int = 0  # verifications that rejected at least one draft token
    emitted: int = 0  # tokens emitted by verification steps (prefill's first token excluded)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def rollback_rate(self) -> float:
        return self.rollbacks / self.worker_steps if self.worker_steps else 0.0

    @property
    def tokens_per_worker_step(self) -> float:
        return self.emitted / self.worker_steps if self.worker_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "proposed": self.proposed, "accepted": self.accepted, "worker_steps": self.worker_steps,
            "rollbacks": self.rollbacks, "emitted": self.emitted, "acceptance_rate": self.acceptance_rate,
            "rollback_rate": self.rollback_rate, "tokens_per_worker_step": self.tokens_per_worker_step,
        }  # fmt: skip


class SpeculativeDecoder:
    """Greedy speculative generation with a worker and a drafter sharing one vocabulary.

    Args:
        worker: the engine whose greedy output is reproduced.
        drafter: the small proposing engine (same tokenizer).
        k: initial draft length; ``adaptive`` moves it within ``[k_min, k_max]``.
    """

    def __init__(
        self, worker: TorchEngine, drafter: TorchEngine, k: int = 4, *, adaptive: bool = True, k_min: int = 1,
        k_max: int = 8,
    ) -> None:  # fmt: skip
        if not 1 <= k_min <= k <= k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got k_min={k_min}, k={k}, k_max={k_max}")
        if worker.config.vocab_size != drafter.config.vocab_size:
            raise ValueError(f"worker vocab {worker.config.vocab_size} != drafter vocab {drafter.config.vocab_size}")
        self.worker, self.drafter = worker, drafter
        self.k, self.adaptive, self.k_min, self.k_max = k, adaptive, k_min, k_max
        self.stats = SpeculativeStats()

    def _adapt(self, accepted: int, proposed: int) -> None:
        if not self.adaptive:
            return
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif accepted * 2 < proposed:
            self.k = max(self.k - 1, self.k_min)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> Iterator[int]:
        """Stream the worker's greedy continuation of ``prompt_ids`` (a stop id is yielded, then it ends)."""
        stops = frozenset(int(s) for s in stop_ids)
        worker, drafter = self.worker, self.drafter
        limit = min(worker.max_seq_len, drafter.max_seq_len)
        history = [int(t) for t in prompt_ids]  # prompt + emitted; the last one is in no cache yet
        last = int(torch.argmax(worker.prefill(history)))
        drafter.prefill(history)
        emitted = 0
        while True:
            history.append(last)
            emitted += 1
            yield last
            if last in stops or emitted >= max_new_tokens:
                return
            position = len(history) - 1  # where ``last`` goes
            # draft k tokens, never beyond the caches or the remaining budget
            k = min(self.k, limit - position - 1, max_new_tokens - emitted)
            if k < 1:  # no room to speculate: plain worker step
                last = int(torch.argmax(worker.decode_step(last)))
                continue
            drafter.rollback(min(drafter.position, position))
            logits = drafter.extend(history[drafter.position :])  # catch up, then ``last``
            drafts = [int(torch.argmax(logits))]
            for _ in range(k - 1):
                drafts.append(int(torch.argmax(drafter.decode_step(drafts[-1]))))
            verify = worker.extend_all([last, *drafts])  # (k + 1, V): one worker forward
            choices = verify.argmax(dim=-1).tolist()  # worker's greedy token after each written token
            accepted = 0
            while accepted < k and drafts[accepted] == choices[accepted]:
                accepted += 1
            worker.rollback(position + 1 + accepted)  # keep ``last`` and the accepted drafts
            self.stats.proposed += k
            self.stats.accepted += accepted
            self.stats.worker_steps += 1
            self.stats.rollbacks += int(accepted < k)
            self.stats.emitted += accepted + 1
            self._adapt(accepted, k)
            for token in drafts[:accepted]:
                history.append(token)
                emitted += 1
                yield token
                if token in stops or emitted >= max_new_tokens:
                    return
            last = choices[accepted]
