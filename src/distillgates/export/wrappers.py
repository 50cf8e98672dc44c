"""Export modules: prefill (enumerated lengths) and one-token decode over a stateful KV cache.

Design choices:
- The KV cache is one fp32 buffer pair per layer, ``k_cache_{i}``/``v_cache_{i}`` of shape
  ``(1, n_kv, S_max, hd)`` registered on the wrapper. torch.export sees them as mutated buffers
  and coremltools turns each into a ``ct.StateType`` (stored fp16: Core ML states are fp16). Both
  wrappers register the same names and shapes, so prefill and decode share one state layout.
- Inputs are int32 and every index stays int32 (int64 has no ANE path and Core ML casts it).
- Prefill pads the prompt to an enumerated length ``L``: positions are ``0..L-1``, keys at or past
  ``length`` are masked out, so padded slots are never attended; the logits are those of the last
  real token (``length - 1``), the only ones a runtime needs for the first generated token.
  K/V are written with a one-hot matmul (``cache * keep + onehot^T @ k``): index_put with a vector
  of positions lowers to ``scatter_nd`` (off the ANE, plus shape ops), the one-hot form is
  elementwise + matmul and exact (one non-zero term per slot).
- Decode writes one slot and attends over the whole cache with ``slot <= position``: stale or
  padded slots beyond ``position`` are never attended. The write is the one op the two backends
  need differently (``kv_write``): Core ML gets ``cache[:, :, pos] = k`` (an index_put, lowered to
  ``slice_update``); Core AI gets ``cache.index_copy_(2, pos, k)``, because its runtime aborts the
  process on that index_put (``Indexing.swift: Index 1 is out of bounds for dimension 0``) and
  coremltools 9.0 has no ``index_copy``. Both write the same slot with the same values.
- A sliding layer whose window ``W`` is narrower than ``S_max`` (Gemma 3) keeps a ring of ``W`` slots, as ANEMLL's
  rotating local cache: position ``p`` lives in slot ``p mod W``, so the ring holds exactly the window
  (``ModelConfig.state_len``). Decode writes slot ``position mod W`` and attends slots ``<= position`` (every slot from
  position ``W - 1`` on). Prefill attends its own keys (the window mask) and writes only the last ``W``
  real positions into the ring (padding and older positions would land on slots the window still needs).
  ``ring=False`` keeps the full cache with a window mask (the comparison in ``benchmarks/bench_ring_cache.py``).
- The wrappers compute in the core's dtype (the buffers follow ``.half()``): Core AI's fp16 compute is
  the fp16 model itself, where Core ML casts an fp32 program (``compute_precision``).
- Every reshape uses ``-1`` instead of a traced length: a traced size would leave ``shape`` ops
  in the Core ML program (see the dynamic-shape lint).
- The programs return what the layout's ``head`` returns: ``logits (1, V)``, or for a vocabulary
  above the ANE's dimension limit its chunks ``(1, V_i)`` as separate outputs
  (:func:`distillgates.export.layout.head_widths`).
- GQA without ``repeat_interleave``: queries of one KV group are adjacent heads, so
  ``q.reshape(1, n_kv, G*T, hd)`` attends the un-repeated K/V with the mask tiled G times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distillgates.export.layout import ANETransformer, Logits, StandardLayout
from distillgates.model import apply_rope

Layout = StandardLayout | ANETransformer


def state_names(n_layers: int) -> list[str]:
    return [f"{kind}_cache_{i}" for i in range(n_layers) for kind in ("k", "v")]


KV_WRITES = ("slice_update", "index_copy")  # Core ML's, Core AI's (see the module docstring)


class _KVModule(nn.Module):
    slots: Tensor  # buffer (S_max,) int32, see __init__
    ring_slots: Tensor  # buffer (W,) int32, with a ring only
    slot_of: Tensor  # buffer (S_max,) int32: position p's ring slot p mod W, with a ring only

    def __init__(self, core: Layout, ring: bool = True) -> None:
        super().__init__()
        self.core = core
        cfg = core.config
        self.n_layers, self.n_heads, self.n_kv_heads = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or 0
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None  # None: 1/sqrt(hd)
        self.ring = cfg.ring_len if ring else None  # W: the sliding layers' ring of slots (module docstring)
        dtype = next(core.parameters()).dtype  # fp32, or fp16 for Core AI's fp16 compute
        for i in range(cfg.n_layers):
            shape = (1, cfg.n_kv_heads, self.state_len(i), self.head_dim)
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("slots", torch.arange(cfg.max_seq_len, dtype=torch.int32), persistent=False)
        if self.ring:  # the ring's slots, and each position's slot (a table: Core AI's runtime has no remainder)
            self.register_buffer("ring_slots", torch.arange(self.ring, dtype=torch.int32), persistent=False)
            self.register_buffer("slot_of", self.slots % self.ring, persistent=False)

    def state_len(self, i: int) -> int:
        return self.core.config.state_len(i) if self.ring else self.core.config.max_seq_len

    def cache(self, kind: str, i: int) -> Tensor:
        return getattr(self, f"{kind}_cache_{i}")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q ``(1, H, T, hd)``, k/v ``(1, n_kv, S, hd)``, mask ``(T, S)`` bool -> ``(1, H, T, hd)``."""
        groups = self.n_heads // self.n_kv_heads
        qg = q.reshape(1, self.n_kv_heads, -1, self.head_dim)  # (1, n_kv, G*T, hd)
        y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(groups, 1),
                                           scale=self.scale)  # (1, n_kv, G*T, hd)  # fmt: skip
        return y.reshape(1, self.n_heads, -1, self.head_dim)  # (1, H, T, hd)

    def layer_inputs(self, mask: Tensor, rows: Tensor, keys: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per layer ``(cos, sin, mask)``: the global tables' ``rows`` and ``mask``; a sliding layer (Gemma 3) its
        own tables' rows and ``mask`` less the keys a window or more behind the query (``rows`` ``(T,)`` the query
        positions, ``keys`` ``(S,)`` the key positions, both int32)."""
        cfg = self.core.config
        full = (self.core.rope[0][rows], self.core.rope[1][rows], mask)
        if not cfg.layer_types or "sliding_attention" not in cfg.layer_types:
            return [full] * self.n_layers
        near = keys[None, :] > rows[:, None] - (cfg.sliding_window or 0)  # (T, S): within the window
        local_cos, local_sin = self.core.local_rope
        local = (local_cos[rows], local_sin[rows], torch.logical_and(mask, near))
        return [local if cfg.sliding(i) else full for i in range(self.n_layers)]


class PrefillModule(_KVModule):
    """``(input_ids (1, L) int32, length (1,) int32) -> logits (1, V)`` (or its chunks); writes slots ``0..L-1`` (a
    ring: the last ``W`` real positions, module docstring)."""

    def forward(self, input_ids: Tensor, length: Tensor) -> Logits:
        ones = input_ids[0] * 0 + 1  # (L,) int32, elementwise: no fill/shape op
        pos = torch.cumsum(ones, 0, dtype=torch.int32) - 1  # (L,)
        causal = pos[None, :] <= pos[:, None]  # (L, L)
        real_key = pos[None, :] < length[:, None]  # (1, L): padded keys are never attended
        inputs = self.layer_inputs(torch.logical_and(causal, real_key), pos, pos)  # (L, hd) x2, (L, L) a layer
        x = self.core.embed_tokens(input_ids)
        onehot = (pos[:, None] == self.slots[None, :]).to(x.dtype)  # (L, S_max)
        full = (onehot, 1.0 - onehot.sum(0)[:, None])  # (L, S_max), keep (S_max, 1)
        ring = None
        if self.ring:  # the last W real positions, each to its slot p mod W
            last = torch.logical_and(pos >= length - self.ring, pos < length)  # (L,)
            ring_hot = torch.logical_and(self.slot_of[pos][:, None] == self.ring_slots[None, :],
                                         last[:, None]).to(x.dtype)  # (L, W)  # fmt: skip
            ring = (ring_hot, 1.0 - ring_hot.sum(0)[:, None])
        for i in range(self.n_layers):
            cos, sin, mask = inputs[i]
            q, k, v = self.core.qkv(i, x)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (1, H|n_kv, L, hd)
            hot, keep = ring if ring is not None and self.core.config.sliding(i) else full
            for kind, new in (("k", k), ("v", v)):
                cache = self.cache(kind, i)
                cache.copy_(cache * keep + torch.matmul(hot.t(), new))  # (1, n_kv, S_max | W, hd)
            x = self.core.finish_block(i, x, self.attend(q, k, v, mask))
        return self.core.head(self.core.select(x, length - 1))  # (1, V)


class DecodeModule(_KVModule):
    """``(input_ids (1, 1) int32, position (1,) int32) -> logits (1, V)`` (or its chunks); writes slot ``position``
    with ``kv_write`` (``slice_update`` for Core ML, ``index_copy`` for Core AI)."""

    def __init__(self, core: Layout, kv_write: str = "slice_update", ring: bool = True) -> None:
        super().__init__(core, ring)
        if kv_write not in KV_WRITES:
            raise ValueError(f"kv_write must be one of {KV_WRITES}, got {kv_write!r}")
        self.kv_write = kv_write

    def forward(self, input_ids: Tensor, position: Tensor) -> Logits:
        mask = self.slots[None, :] <= position[:, None]  # (1, S_max)
        inputs = self.layer_inputs(mask, position, self.slots)  # (1, hd) x2, (1, S_max) a layer
        ring = None
        if self.ring:  # slot position mod W; slots <= position hold the window (all of them once position >= W - 1)
            ring = (self.slot_of[position], self.ring_slots[None, :] <= position[:, None])  # (1,), (1, W)
        x = self.core.embed_tokens(input_ids)
        for i in range(self.n_layers):
            cos, sin, mask = inputs[i]
            q, k, v = self.core.qkv(i, x)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (1, H|n_kv, 1, hd)
            k_cache, v_cache = self.cache("k", i), self.cache("v", i)
            slot, mask = ring if ring is not None and self.core.config.sliding(i) else (position, mask)
            if self.kv_write == "index_copy":
                index = slot.long()  # index_copy takes int64 indices; the program's input stays int32
                k_cache.index_copy_(2, index, k)
                v_cache.index_copy_(2, index, v)
            else:
                k_cache[:, :, slot] = k  # slice_update of one slot
                v_cache[:, :, slot] = v
            x = self.core.finish_block(i, x, self.attend(q, k_cache, v_cache, mask))
        return self.core.head(x)  # (1, V)
