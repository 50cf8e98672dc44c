"""PyTorch engine over :class:`distillgates.model.Transformer` with its static KV cache.

Design choices (gpt-fast style):
- The KV cache is allocated once (``model.setup_caches``); resetting a conversation only moves
  the position back to 0. Slots past the position hold stale values that the causal mask never
  lets a query see, so no zeroing is needed, and rollback (speculative decoding) is free.
- The decode path reuses pre-allocated ``(1, 1)`` token and ``(1,)`` position tensors (filled in
  place) and slices of a pre-built ``arange``; nothing is allocated per token outside the model.
- Batches (``write_rows``: the batched eval, and ``prefill_batch``/``decode_batch`` over it): each cache
  row holds its own conversation at its own positions (RoPE and causal mask per row), so a row that
  finishes takes a new prompt while the others keep decoding; no left padding of the history, no
  re-prefill.
- Every write runs a :class:`~distillgates.runtime.decoder.FusedDecoder` built from the model
  (under ``inference_mode``): fused, pre-transposed weights, attention over the filled prefix
  only, no module calls. ``prefill``/``extend`` need the last position's logits only
  (``last_only``: the last layer and the LM head skip the other rows); ``extend_all``
  (speculative verification) returns every row. ``torch.compile`` of the one-token decode step
  is optional (``compile=True``) and off by default: it compiles the model's own forward (same
  cache buffers), costs ~20 s of compilation, and ``benchmarks/bench_decode_vs_hf.py --compile``
  measures whether it pays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from distillgates.model import Transformer
from distillgates.runtime.base import EngineBase, make_generator, sample_token
from distillgates.runtime.decoder import FusedDecoder

# Test hook of the speed gates' power benchmark: a real engine slowdown. Each prefill/decode call does this
# fraction more work: it spins until the thread's CPU time has grown by the fraction of the CPU time the call
# took, as code doing that much more work would. (A wall-clock stretch is not that: on a loaded machine the
# call's wall time includes the time given to other processes, and the spin then waits for the CPU in turn;
# at load 8 on 2 cores a 10% wall-clock stretch read as a 1.9x lower TPS.)
SLOWDOWN_ENV = "DISTILLGATES_TEST_ENGINE_SLOWDOWN"


def _stretched(call: Callable[..., Tensor], fraction: float) -> Callable[..., Tensor]:
    def slower(*args: object) -> Tensor:
        start = time.thread_time()
        out = call(*args)
        until = start + (1.0 + fraction) * (time.thread_time() - start)
        while time.thread_time() < until:
            pass
        return out

    return slower


class TorchEngine(EngineBase):
    """Batch-1 engine (the protocol) plus continuous batching over the cache rows (``write_rows``; offline
    batches of prompts: ``prefill_batch``/``decode_batch``/``generate_batch``).

    Args:
        model: the transformer; put in eval mode and given a static cache of ``max_batch_size``.
        max_batch_size: rows of the static cache (1 for interactive use, 2-4 offline).
        cache_dtype: KV cache dtype (default: the weights' dtype).
        compile: ``torch.compile`` the one-token decode step (the model's forward, not the decoder).
    """

    def __init__(
        self,
        model: Transformer,
        max_batch_size: int = 1,
        cache_dtype: torch.dtype | None = None,
        compile: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.config = model.config
        self.max_seq_len = model.config.max_seq_len
        self.max_batch_size = max_batch_size
        self.device = model.embed.weight.device
        model.setup_caches(max_batch_size, cache_dtype)
        self.decoder = FusedDecoder(model)
        self._positions = torch.arange(self.max_seq_len, device=self.device)  # (S_max,) sliced, never rebuilt
        self._token = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # (1, 1) decode input
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,) decode position
        self._batch_lens: list[int] = []  # tokens in each row of the current batch (prefill_batch/decode_batch)
        self._decode = torch.compile(self._decode_compiled, dynamic=False) if compile else self._decode_eager
        self.tokens: list[int] = []  # token ids in the KV state (batch-1 conversation)
        self.pending = None
        slowdown = float(os.environ.get(SLOWDOWN_ENV) or 0.0)
        if slowdown > 0:  # benchmarks/bench_speed_gate_power.py: a real +10% / +20% engine regression
            self.prefill = _stretched(self.prefill, slowdown)  # type: ignore[method-assign]
            self.decode_step = _stretched(self.decode_step, slowdown)  # type: ignore[method-assign]

    # ---- batch 1: the Engine protocol ------------------------------------------------

    @property
    def position(self) -> int:
        """Number of tokens in the KV state (the next write position)."""
        return len(self.tokens)

    def _decode_eager(self, token: Tensor, pos: Tensor) -> Tensor:
        return self.decoder.forward(token, pos).view(-1)  # (1, 1, V) -> (V,): a view, no indexing op

    def _decode_compiled(self, token: Tensor, pos: Tensor) -> Tensor:
        return self.model(token, pos).view(-1)  # traced by torch.compile: the module path, same cache

    def _check_room(self, n: int) -> None:
        if self.position + n > self.max_seq_len:
            raise ValueError(f"sequence of {self.position + n} tokens exceeds max_seq_len {self.max_seq_len}")

    @torch.inference_mode()
    def _write(self, token_ids: list[int], last_only: bool) -> Tensor:
        """Write ``token_ids`` at the current position; logits ``(T, V)``, or ``(1, V)`` with ``last_only``."""
        if len(token_ids) == 0:
            raise ValueError("need at least one token to write")
        self._check_room(len(token_ids))
        start = self.position
        idx = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # (1, T)
        positions = self._positions[start : start + len(token_ids)]
        logits = self.decoder.forward(idx, positions, last_only=last_only)  # (1, T, V), or (1, 1, V)
        self.tokens.extend(token_ids)
        return logits[0]

    def prefill(self, prompt_ids: Sequence[int]) -> Tensor:
        """Reset the conversation and write the prompt; logits ``(V,)`` of the last prompt position."""
        self.tokens = []
        self.pending = None
        return self._write([int(t) for t in prompt_ids], last_only=True)[-1]

    @torch.inference_mode()
    def decode_step(self, token: int) -> Tensor:
        """Write one token; logits ``(V,)`` for the next one."""
        if self.pending is not None and token != self.pending:
            raise ValueError(f"token {self.pending} is pending (not in the KV state); extend() writes it")
        self.pending = None
        self._check_room(1)
        self._token.fill_(token)
        self._pos.fill_(self.position)
        logits = self._decode(self._token, self._pos)  # (V,)
        self.tokens.append(int(token))
        return logits

    def extend_all(self, token_ids: Sequence[int]) -> Tensor:
        """Write the pending token (if any) then ``token_ids`` in one forward; logits ``(T, V)`` for every
        written token. Speculative verification uses the rows; multi-turn continuation the last."""
        return self._write(self._take_pending(token_ids), last_only=False)

    def extend(self, token_ids: Sequence[int]) -> Tensor:
        """Append tokens (e.g. a tool result) to the conversation; logits ``(V,)`` of the last one."""
        return self._write(self._take_pending(token_ids), last_only=True)[-1]

    def _take_pending(self, token_ids: Sequence[int]) -> list[int]:
        ids = ([self.pending] if self.pending is not None else []) + [int(t) for t in token_ids]
        self.pending = None
        return ids

    # ---- KV state access (prompt cache) ----------------------------------------------

    def read_kv(self, length: int) -> list[tuple[Tensor, Tensor]]:
        """Copies of the first ``length`` cache slots per layer: ``[(k, v)]`` each ``(n_kv, length, hd)``."""
        if length > self.position:
            raise ValueError(f"only {self.position} tokens in the KV state, asked for {length}")
        return [(k[0, :, :length].clone(), v[0, :, :length].clone()) for k, v in self.decoder.caches]

    def write_kv(self, token_ids: Sequence[int], kv: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Reset the conversation to ``token_ids`` whose K/V (from :meth:`read_kv`) are copied in."""
        length = len(token_ids)
        if len(kv) != len(self.model.layers) or any(k.shape[1] != length for k, _ in kv):
            raise ValueError(f"KV slices do not match {len(self.model.layers)} layers x {length} tokens")
        if length > self.max_seq_len:
            raise ValueError(f"{length} cached tokens exceed max_seq_len {self.max_seq_len}")
        for (k_cache, v_cache), (k, v) in zip(self.decoder.caches, kv, strict=True):
            k_cache[0, :, :length].copy_(k)
            v_cache[0, :, :length].copy_(v)
        self.tokens = [int(t) for t in token_ids]
        self.pending = None

    # ---- small batches (offline) -------------------------------------------------------

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Prefill ``prompts`` into cache rows ``0..B-1`` together (:meth:`write_rows`); logits ``(B, V)``.

        Resets the batch-1 conversation too (they share the cache rows).
        """
        if not 1 <= len(prompts) <= self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts, engine has max_batch_size {self.max_batch_size}")
        logits = self.write_rows(range(len(prompts)), prompts, [0] * len(prompts))
        self._batch_lens = [len(p) for p in prompts]
        return logits

    def decode_batch(self, tokens: Sequence[int]) -> Tensor:
        """One step for every row of the current batch (one token each); logits ``(B, V)``."""
        if len(tokens) != len(self._batch_lens):
            raise ValueError(f"expected {len(self._batch_lens)} tokens (one per row), got {len(tokens)}")
        logits = self.write_rows(range(len(tokens)), [[t] for t in tokens], self._batch_lens)
        self._batch_lens = [n + 1 for n in self._batch_lens]
        return logits

    @torch.inference_mode()
    def write_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int]) -> Tensor:
        """Continuous batching: each cache row holds its own conversation. Write ``chunks[i]`` into cache row
        ``rows[i]`` at positions ``starts[i]...`` (the tokens that row already has); logits ``(len(rows), V)``
        after each chunk's last token. Other rows are untouched.

        Chunks are left-padded to one length; a row's padding is written at the slot after its chunk, where
        its next write goes, and no query of the row attends it (each row sees its slots up to each query's
        position, ``FusedDecoder.forward`` with per-row positions). Resets the batch-1 conversation (it
        shares row 0).

        Raises:
            ValueError: a row outside ``max_batch_size`` or twice, an empty chunk, or a chunk that reaches the
                last slot (one slot stays free for padding; the batch-1 path never writes it either: its
                last token is pending).
        """
        if len(chunks) != len(rows) or len(starts) != len(rows) or len(set(rows)) != len(rows) or not rows:
            raise ValueError(f"need one chunk and one start per distinct row, got rows {list(rows)}")
        if not all(0 <= row < self.max_batch_size for row in rows):
            raise ValueError(f"rows {list(rows)} outside the engine's max_batch_size {self.max_batch_size}")
        if any(not c or start < 0 or start + len(c) >= self.max_seq_len for c, start in zip(chunks, starts)):
            raise ValueError(f"chunks must be non-empty and leave the last of max_seq_len {self.max_seq_len} slots "
                             f"free (starts {list(starts)}, lengths {[len(c) for c in chunks]})")  # fmt: skip
        length = max(len(chunk) for chunk in chunks)
        pads = [length - len(chunk) for chunk in chunks]
        # pad id 0; a row's padding goes to the slot after its chunk, overwritten by the row's next write
        idx = [[0] * pad + [int(t) for t in chunk] for pad, chunk in zip(pads, chunks)]
        positions = [[s + len(c)] * pad + list(range(s, s + len(c))) for pad, c, s in zip(pads, chunks, starts)]
        self.tokens, self.pending = [], None
        logits = self.decoder.forward(
            torch.tensor(idx, dtype=torch.long, device=self.device),  # (B, T)
            torch.tensor(positions, dtype=torch.long, device=self.device),  # (B, T)
            last_only=True,
            cache_rows=torch.tensor(list(rows), dtype=torch.long, device=self.device),  # (B,)
        )
        return logits[:, -1]  # (B, V)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Generate for up to ``max_batch_size`` prompts at once (offline). A row stops at its first stop
        id (included); finished rows keep stepping (their tokens are dropped) until all are done."""
        stops = frozenset(int(s) for s in stop_ids)
        generator = make_generator(seed, self.device) if temperature > 0 else None
        logits = self.prefill_batch(prompts)  # (B, V)
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for step in range(max_new_tokens):
            tokens = []
            for row in range(len(prompts)):
                token = sample_token(logits[row], temperature, top_p, generator)
                if not done[row]:
                    outputs[row].append(token)
                    done[row] = token in stops
                tokens.append(token)
            if all(done) or step == max_new_tokens - 1:
                break
            logits = self.decode_batch(tokens)
        return outputs
