"""Prompt cache: reuse the KV state of a shared prefix (the system prompt) across requests.

Design choices:
- Keys are token prefixes, not text: a hit needs the prompt to *start with* the stored tokens, so
  a prompt that shares the system prompt but differs after it still hits. Lookup takes the
  longest stored prefix (few entries: one per locale's system prompt).
- Entries hold K/V copies ``(n_kv, P, hd)`` per layer plus the logits of the last prefix token
  (needed when the prompt *is* the prefix). Eviction is LRU by bytes under a byte budget.
- On a miss the prefix is prefilled on its own and the suffix written with ``extend``; on a hit
  the stored K/V are copied into the static cache and only the suffix is written. Both paths run
  the very same suffix computation, so hit and miss give bit-identical logits; against a plain
  one-shot prefill they agree to float rounding (greedy tokens identical, see tests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from distillgates.runtime.base import EngineBase
from distillgates.runtime.torch_engine import TorchEngine


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    kv: list[tuple[Tensor, Tensor]]  # per layer (k, v), each (n_kv, P, hd)
    last_logits: Tensor  # (V,) after the last prefix token
    nbytes: int


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PromptCache:
    """LRU store of prefix K/V, bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], CacheEntry] = OrderedDict()
        self.nbytes = 0
        self.stats = PromptCacheStats()

    def lookup(self, prompt_ids: Sequence[int]) -> CacheEntry | None:
        """Longest stored prefix of ``prompt_ids`` (marked most recently used), counting a hit or miss."""
        prompt = tuple(prompt_ids)
        best = None
        for key, entry in self.entries.items():
            if len(key) <= len(prompt) and prompt[: len(key)] == key and (best is None or len(key) > len(best.tokens)):
                best = entry
        if best is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.entries.move_to_end(best.tokens)
        return best

    def insert(self, tokens: Sequence[int], kv: list[tuple[Tensor, Tensor]], last_logits: Tensor) -> bool:
        """Store a prefix; evicts least recently used entries to fit. Returns False if it can never fit."""
        key = tuple(int(t) for t in tokens)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + last_logits.nbytes
        if nbytes > self.max_bytes:
            return False
        if key in self.entries:
            self.nbytes -= self.entries.pop(key).nbytes
        while self.nbytes + nbytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.stats.evictions += 1
        self.entries[key] = CacheEntry(key, kv, last_logits.clone(), nbytes)
        self.nbytes += nbytes
        return True


class PromptCachedEngine(EngineBase):
    """An engine whose ``prefill`` reuses cached prefix K/V; everything else is the inner engine's.

    Args:
        engine: the engine whose static cache is filled (needs ``read_kv``/``write_kv``).
        cache: the prompt cache.
        prefix_len: ``prompt_ids -> length of the shareable prefix`` (e.g. the system prompt up to
            and including its ``<|end|>``); 0 means "do not cache this prompt".
    """

    def __init__(self, engine: TorchEngine, cache: PromptCache, prefix_len: Callable[[Sequence[int]], int]) -> None:
        self.engine = engine
        self.cache = cache
        self.prefix_len = prefix_len

    @property
    def pending(self) -> int | None:  # type: ignore[override]
        return self.engine.pending

    @pending.setter
    def pending(self, token: int | None) -> None:
        self.engine.pending = token

    def prefill(self, prompt_ids: Sequence[int]) -> Tensor:
        prompt = [int(t) for t in prompt_ids]
        entry = self.cache.lookup(prompt)
        if entry is None:
            n = self.prefix_len(prompt)
            if not 0 < n <= len(prompt):
                return self.engine.prefill(prompt)
            logits = self.engine.prefill(prompt[:n])
            self.cache.insert(prompt[:n], self.engine.read_kv(n), logits)
        else:
            n = len(entry.tokens)
            self.engine.write_kv(entry.tokens, entry.kv)
            logits = entry.last_logits
        return self.engine.extend(prompt[n:]) if n < len(prompt) else logits.clone()

    def decode_step(self, token: int) -> Tensor:
        return self.engine.decode_step(token)

    def extend(self, token_ids: Sequence[int]) -> Tensor:
        return self.engine.extend(token_ids)


def prefix_until(marker_id: int) -> Callable[[Sequence[int]], int]:
    """``prefix_len`` for :class:`PromptCachedEngine`: up to and including the first ``marker_id``
    (e.g. the ``<|end|>`` closing the system prompt); 0 when absent."""

    def length(prompt_ids: Sequence[int]) -> int:
        for i, token in enumerate(prompt_ids):
            if token == marker_id:
                return i + 1
        return 0

    return length
