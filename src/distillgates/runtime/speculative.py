"""Greedy speculative decoding: a drafter proposes k tokens, the worker verifies them in one forward.

Design choices:
- Both models run on :class:`TorchEngine` static caches; a rejected draft is rolled back by moving
  the position (stale slots are masked by causality), so rollback costs nothing.
- Verification writes ``[last, d1..dk]`` at positions ``p..p+k`` in ONE worker forward; row ``i``
  is the worker's greedy choice after ``d_i``. The longest prefix with ``d_{i+1} == argmax(row i)``
  is accepted, plus the worker's own token at the first mismatch (or the bonus token after
  ``dk``). Every emitted token is therefore the worker's greedy choice: the output is the
  worker's greedy output (bit-identical in exact arithmetic; tested in float64).
- The drafter stops drafting at a stop id (nothing after it is ever emitted), and its prompt prefill
  waits for the worker's first token so that one forward both prefills and drafts.
- Cost-aware adaptive k: the k in [k_min, k_max] that maximises expected tokens per cycle over the
  cycle's cost, ``E(k) / (k c + 1)`` with ``E(k) = (1 - a^(k+1)) / (1 - a)`` (Leviathan et al.,
  eq. 1 and sec. 3.4), from the running per-draft acceptance ``a`` and the measured cost ``c`` of
  one draft step in verification forwards. A drafter that is right almost always is given long
  drafts; a mediocre one short drafts (k = 1 beats k = 4 at a = 0.8, c = 0.65).

Reference: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"
(greedy case).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from distillgates.runtime.torch_engine import TorchEngine

DECAY = 0.9  # per verification: the acceptance and cost estimates follow the last ~10 cycles


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
        k: initial draft length; ``adaptive`` then picks it in ``[k_min, k_max]`` after every verification.
        draft_cost: time of one draft step over one verification forward, for the adaptive choice;
            None measures it while generating (fix it for a choice that does not depend on timing).
    """

    def __init__(
        self, worker: TorchEngine, drafter: TorchEngine, k: int = 4, *, adaptive: bool = True, k_min: int = 1,
        k_max: int = 32, draft_cost: float | None = None,
    ) -> None:  # fmt: skip
        if not 1 <= k_min <= k <= k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got k_min={k_min}, k={k}, k_max={k_max}")
        if draft_cost is not None and not draft_cost > 0:
            raise ValueError(f"draft_cost must be > 0 (or None to measure it), got {draft_cost}")
        if worker.config.vocab_size != drafter.config.vocab_size:
            raise ValueError(f"worker vocab {worker.config.vocab_size} != drafter vocab {drafter.config.vocab_size}")
        self.worker, self.drafter = worker, drafter
        self.k, self.adaptive, self.k_min, self.k_max = k, adaptive, k_min, k_max
        self.draft_cost = draft_cost
        self.stats = SpeculativeStats()
        # decayed counts of accepted / rejected draft positions; the prior (mean 0.8, weight 2.5) is soon outweighed
        self._hits, self._misses = 2.0, 0.5
        self._measured_cost: float | None = None  # running draft step time / verification time

    def _adapt(self, accepted: int, proposed: int, step_s: float | None, verify_s: float) -> None:
        """Pick k for the next cycle: ``argmax_k E(k) / (k c + 1)`` (see the module docstring)."""
        if not self.adaptive:
            return
        self._hits = DECAY * self._hits + accepted
        self._misses = DECAY * self._misses + (accepted < proposed)  # a cycle ends at its first rejection
        if step_s is not None:
            ratio = step_s / verify_s
            cost = self._measured_cost
            self._measured_cost = ratio if cost is None else DECAY * cost + (1 - DECAY) * ratio
        cost = self.draft_cost if self.draft_cost is not None else self._measured_cost
        if cost is None:  # no draft step timed yet
            return
        a = self._hits / (self._hits + self._misses)  # per-draft acceptance
        best, expected, power = 0.0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            power *= a
            expected += power  # E(k) = 1 + a + ... + a^k
            if k >= self.k_min and expected / (k * cost + 1) > best:
                best, self.k = expected / (k * cost + 1), k

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
        drafter.rollback(0)  # the first catch-up below is the drafter's prefill, ``last`` included
        emitted = 0
        while True:
            history.append(last)
            emitted += 1
            yield last
            if last in stops or emitted >= max_new_tokens:
                return
            position = len(history) - 1  # where ``last`` goes
            # k drafts, never beyond the caches; k + 1 tokens at most fill the remaining budget
            k = min(self.k, limit - position - 1, max_new_tokens - emitted - 1)
            if k < 1:  # no room to speculate: plain worker step
                last = int(torch.argmax(worker.decode_step(last)))
                continue
            drafter.rollback(min(drafter.position, position))
            prefill = drafter.position == 0  # first cycle: the catch-up is the prompt, not a timed draft step
            catch_up = history[drafter.position :]  # ``last``, after the rejected or unwritten last draft
            started = time.perf_counter()
            drafts = [int(torch.argmax(drafter.extend(catch_up)))]
            if prefill:
                started = time.perf_counter()
            while len(drafts) < k and drafts[-1] not in stops:  # nothing after a stop id is ever emitted
                drafts.append(int(torch.argmax(drafter.decode_step(drafts[-1]))))
            drafted = time.perf_counter()
            verify = worker.extend_all([last, *drafts])  # (n + 1, V): one worker forward
            choices = verify.argmax(dim=-1).tolist()  # worker's greedy token after each written token
            verified = time.perf_counter()
            proposed, accepted = len(drafts), 0
            while accepted < proposed and drafts[accepted] == choices[accepted]:
                accepted += 1
            worker.rollback(position + 1 + accepted)  # keep ``last`` and the accepted drafts
            steps = proposed - int(prefill)
            self._adapt(accepted, proposed, (drafted - started) / steps if steps else None, verified - drafted)
            self.stats.proposed += proposed
            self.stats.accepted += accepted
            self.stats.worker_steps += 1
            self.stats.rollbacks += int(accepted < proposed)
            self.stats.emitted += accepted + 1
            for token in drafts[:accepted]:
                history.append(token)
                emitted += 1
                yield token
                if token in stops or emitted >= max_new_tokens:
                    return
            last = choices[accepted]
