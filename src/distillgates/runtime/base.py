"""Engine protocol, sampling and the shared streaming generation loop.

Design choices:
- An engine is a stateful cursor over one conversation: ``prefill`` resets it and writes the
  prompt, ``decode_step`` writes one token, ``extend`` writes several (multi-turn continuation,
  speculative verification). ``generate`` is written once here on top of those three, so the
  PyTorch engine, the Core ML engine and wrappers (prompt cache) share the exact same loop.
- The last token ``generate`` yields is *pending*: it is not in the KV state yet (writing it
  costs a forward that is wasted when the caller stops). ``extend`` writes the pending token
  first, so a caller continues a conversation with ``extend(tool_result_ids)`` and never
  re-prefills the history.
- Sampling uses an explicit ``torch.Generator`` per call (seeded), never the global RNG, so
  a seeded generation is reproducible whatever else runs in the process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

LogitsProcessor = Callable[[list[int], Tensor], Tensor]
"""``(generated_ids, logits (V,)) -> logits (V,)``; ``generated_ids`` are the tokens generated so
far by this ``generate`` call (not the prompt). Constrained decoding plugs in here."""


@runtime_checkable
class Engine(Protocol):
    def prefill(self, prompt_ids: Sequence[int]) -> Tensor: ...

    def decode_step(self, token: int) -> Tensor: ...

    def extend(self, token_ids: Sequence[int]) -> Tensor: ...

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Iterator[int]: ...


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # fresh non-deterministic seed, still independent of the global RNG
    else:
        gen.manual_seed(seed)
    return gen


def sample_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy when ``temperature == 0``; otherwise temperature + nucleus (top-p) sampling.

    Args:
        logits: ``(V,)`` next-token logits.
    """
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={temperature}, top_p={top_p}")
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (V,)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # (V,)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_loop(
    engine: EngineBase,
    logits: Tensor,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    temperature: float,
    top_p: float,
    seed: int | None,
    logits_processor: LogitsProcessor | None,
) -> Iterator[int]:
    """Stream up to ``max_new_tokens`` tokens starting from ``logits`` (V,); a stop token is yielded
    and ends the stream. The last yielded token is not written into the engine's state."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stops = frozenset(int(s) for s in stop_ids)
    generator = make_generator(seed, logits.device) if temperature > 0 else None
    generated: list[int] = []
    for step in range(max_new_tokens):
        if logits_processor is not None:
            logits = logits_processor(generated, logits)
        token = sample_token(logits, temperature, top_p, generator)
        generated.append(token)
        engine.pending = token  # stays pending if the caller stops here (stop id, budget, or break)
        yield token
        if token in stops or step == max_new_tokens - 1:
            return
        logits = engine.decode_step(token)


class EngineBase(ABC):
    """``generate`` and ``continue_generate`` on top of ``prefill``/``decode_step``/``extend``.

    ``pending`` is the last token ``generate`` yielded that is not in the KV state yet;
    ``decode_step(pending)`` or ``extend(...)`` writes it.
    """

    pending: int | None = None
    tokens: list[int]  # the conversation in the KV state (engines that support rollback keep it)

    if TYPE_CHECKING:

        @property
        def position(self) -> int:
            """Tokens written to the KV state (a property in the engines)."""
            ...

    @abstractmethod
    def prefill(self, prompt_ids: Sequence[int]) -> Tensor:
        """Reset the state, write the prompt; logits (V,) of its last position."""

    @abstractmethod
    def decode_step(self, token: int) -> Tensor:
        """Write one token at the next position; its logits (V,)."""

    @abstractmethod
    def extend(self, token_ids: Sequence[int]) -> Tensor:
        """Append tokens (after the pending one) in one forward; logits (V,) of the last."""

    def rollback(self, position: int) -> None:
        """Forget every token at or after ``position`` (a static cache only moves the position).

        Engines keep the conversation in ``self.tokens`` and report ``self.position``.
        """
        if not 0 <= position <= self.position:
            raise ValueError(f"rollback position {position} outside [0, {self.position}]")
        del self.tokens[position:]
        self.pending = None

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Iterator[int]:
        """Reset, prefill ``prompt_ids`` and stream new tokens (lazily: prefill runs on first ``next``)."""
        logits = self.prefill(prompt_ids)
        yield from sample_loop(
            self, logits, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature,
            top_p=top_p, seed=seed, logits_processor=logits_processor,
        )  # fmt: skip

    def continue_generate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> Iterator[int]:
        """Append ``token_ids`` (e.g. a tool result) to the current conversation and keep generating."""
        logits = self.extend(token_ids)
        yield from sample_loop(
            self, logits, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature,
            top_p=top_p, seed=seed, logits_processor=logits_processor,
        )  # fmt: skip
