"""Llama-style GQA decoder with a static KV cache (gpt-fast style).

Design choices:
- RMSNorm written by hand: ``nn.RMSNorm`` does not convert through ``torch.export`` to
  Core ML (the ``rms_norm`` op), see DESIGN.md "Platform facts".
- Real-valued RoPE with the Hugging Face ``rotate_half`` convention, so weights map 1:1 to
  ``LlamaForCausalLM`` (no q/k permutation) and no complex tensors reach the exporter.
- The KV cache is its own small module with pre-allocated ``(B, n_kv, S_max, hd)`` buffers
  written by index; the same ``forward`` serves training (no cache), prefill and one-token
  decode (``input_pos``).
- Masks are boolean (True = may attend) and passed to SDPA: causal always, padded keys
  never attended, every query keeps at least its own position so no row is all ``-inf``.
- Module names follow Hugging Face Llama (``q_proj``, ``gate_proj``...) to keep the interop
  mapping a rename table.

References: gpt-fast ``model.py``; HF ``modeling_llama.py``; Llama 3 RoPE scaling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from distillgates.config import ModelConfig, RopeScaling, from_dict, sha256_json, to_dict
from distillgates.io import load_checksummed, save_checksummed

if TYPE_CHECKING:
    _M = TypeVar("_M", bound=nn.Module)

    class ModuleListOf(nn.ModuleList, Generic[_M]):
        """Type-checking view of an ``nn.ModuleList`` whose items are all ``_M`` (no runtime class)."""

        def __iter__(self) -> Iterator[_M]: ...

        @overload
        def __getitem__(self, idx: slice) -> nn.ModuleList: ...

        @overload
        def __getitem__(self, idx: int) -> _M: ...

        def __getitem__(self, idx: int | slice) -> _M | nn.ModuleList: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _rms(x: Tensor, d_eps: float) -> Tensor:
    """``rms_norm(x) / sqrt(d)`` without its weight: ``x * rsqrt(sum(x^2) + d * eps)``. The cached
    inference path folds ``weight * sqrt(d)`` into the next matmul (``sum`` is one op, ``mean`` two)."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + d_eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + d_eps)).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies ``(head_dim/2,)``, optionally scaled (linear or Llama 3)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float()
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled).float()


def rope_tables(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(max_seq_len, head_dim)`` in the HF duplicated-half layout."""
    assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)  # (S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd)
    return x * cos + rotate_half(x) * sin


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """GQA without repeating the cache: the G query heads of one KV head are adjacent, so they attend
    the un-repeated K/V as G*T query rows (row ``g*T + t`` needs mask row ``t``: pass ``mask`` tiled
    G times, ``mask.repeat(1, 1, G, 1)``, or None when every key is visible).

    q ``(B, H, T, hd)``, k/v ``(B, n_kv, S, hd)``, mask ``(B|1, 1, G*T, S)`` -> ``(B, H, T, hd)``.
    """
    B, H, T, hd = q.shape
    qg = q.reshape(B, k.shape[1], -1, hd)  # (B, n_kv, G*T, hd)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(B, H, T, hd)


class KVCache(nn.Module):
    """Static pre-allocated cache for one layer, written by position index."""

    k_cache: Tensor  # buffers, (B, n_kv, S_max, hd)
    v_cache: Tensor

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos: (T,); k, v: (B, n_kv, T, hd)
        batch = k.shape[0]
        k_cache, v_cache = self.k_cache, self.v_cache
        if batch != k_cache.shape[0]:
            k_cache, v_cache = k_cache[:batch], v_cache[:batch]  # views of the live rows
        k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype))  # cheaper than index_put (cache[..., pos] = k)
        v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype))
        return k_cache, v_cache

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor | None) -> Tensor:
        """Training (no cache) and the compiled/grad-enabled cache path; eager inference with the cache
        takes :meth:`Transformer._forward_cached` (same parameters, fewer ops)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, n_kv, S_max, hd)
            k, v = k.to(q.dtype), v.to(q.dtype)
            y = gqa_attention(q, k, v, mask.repeat(1, 1, self.n_heads // self.n_kv_heads, 1))  # (B, H, T, hd)
        else:  # training: kept as is (fx-traceable for QAT)
            groups = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor | None) -> Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, mask, input_pos)
        return h + self.mlp(self.mlp_norm(h))


class _InferencePlan(NamedTuple):
    sources: list[Tensor]  # the parameters the cached tensors were built from
    stamp: tuple[tuple[int, int], ...]  # (data_ptr, _version) of each source at build time
    layers: list[tuple[Tensor, Tensor, Tensor, Tensor]]  # (qkv_r^T, o^T, gate_up^T, down^T)
    head: Tensor  # lm_head^T with the final norm folded in
    caches: list[tuple[Tensor, Tensor]]  # (k_cache, v_cache) of each layer, (B_max, n_kv, S_max, hd)


def _drop_plan_hook(module: Transformer, _incompatible_keys: Any) -> None:
    module.drop_inference_plan()


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(idx, input_pos=None, attention_mask=None) -> logits``."""

    rope_cos: Tensor  # buffers, see __init__
    rope_sin: Tensor
    causal_mask: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = cast("ModuleListOf[Block]", nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S_max, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S_max, hd)
        causal = torch.tril(torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)  # (S_max, S_max)
        self.apply(self._init_weights)
        self.cache_batch_size = 0
        self._plan: _InferencePlan | None = None  # see _inference_plan
        self.register_load_state_dict_post_hook(_drop_plan_hook)  # module-level function: picklable

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def setup_caches(self, max_batch_size: int, dtype: torch.dtype | None = None) -> None:
        """Pre-allocate one :class:`KVCache` per layer for ``max_batch_size`` sequences."""
        dtype = dtype or self.embed.weight.dtype
        cfg = self.config
        assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
        for layer in self.layers:
            layer.attn.kv_cache = KVCache(max_batch_size, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, dtype).to(
                self.embed.weight.device
            )
        self.cache_batch_size = max_batch_size
        self.drop_inference_plan()

    def remove_caches(self) -> None:
        for layer in self.layers:
            layer.attn.kv_cache = None
        self.cache_batch_size = 0
        self.drop_inference_plan()

    def drop_inference_plan(self) -> None:
        """Free the cached inference weights (rebuilt on the next cached eager forward)."""
        self._plan = None

    def reset_caches(self) -> None:
        for layer in self.layers:
            if layer.attn.kv_cache is not None:
                layer.attn.kv_cache.reset()

    def _mask(self, T: int, input_pos: Tensor | None, attention_mask: Tensor | None) -> Tensor:
        """Boolean mask (B or 1, 1, T, S): True where the query may attend the key."""
        # (T, T) without cache; (T, S_max) rows of the query positions with it
        mask = self.causal_mask[:T, :T] if input_pos is None else self.causal_mask[input_pos]
        mask = mask[None, None]  # (1, 1, T, S)
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
            own = torch.eye(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
            if input_pos is not None:
                own = F.one_hot(input_pos, mask.shape[-1]).bool()  # (T, S): each query's own slot
            # a padded key is never attended; a padded query keeps its own slot (no all -inf row)
            mask = mask & (keys | own[None, None])
        return mask

    def _inference_plan(self) -> _InferencePlan:
        """Weights of the cached eager path, folded so that each layer is four matmuls:

        - per layer ``(qkv_r^T, o^T, gate_up^T, down^T)``, then ``head^T``; transposed contiguous
          (``x @ W^T`` with a contiguous ``W^T`` is the fast one-row matmul on CPU);
        - ``qkv_r`` = rows ``[q; k; v; R q; R k]`` where ``R`` is RoPE's ``rotate_half`` (a signed
          permutation of rows, so ``R W x`` is exactly ``rotate_half(W x)``): RoPE is then 3 elementwise ops;
        - each RMSNorm weight (times ``sqrt(d)``, see :func:`_rms`) is folded into the columns of the
          matmul that follows it (``(w * n) @ W^T == n @ (w * W)^T`` up to float rounding).

        One extra copy of the linear weights, kept while every source parameter keeps its storage and
        version (in-place updates and ``.to()`` are seen; ``load_state_dict``, ``setup_caches`` and
        ``remove_caches`` drop it; after replacing a Parameter object call :meth:`drop_inference_plan`).
        The plan also lists each layer's cache buffers, so the per-token loop makes no module lookups.
        """
        plan = self._plan
        if plan is not None and plan.stamp == tuple((p.data_ptr(), p._version) for p in plan.sources):
            return plan
        assert self.config.head_dim is not None  # set by ModelConfig.__post_init__
        half = self.config.head_dim // 2

        def rotated(w: Tensor, heads: int) -> Tensor:  # rows of rotate_half(w @ x), per head
            w = w.view(heads, 2, half, -1)
            return torch.cat([-w[:, 1], w[:, 0]], dim=1).reshape(heads * 2 * half, -1)

        def folded(norm: Tensor, *ws: Tensor) -> Tensor:  # (in, out) contiguous, norm weight folded in
            return (torch.cat(ws).float() * (norm.float() * math.sqrt(cfg.d_model))).to(ws[0].dtype).t().contiguous()

        cfg, layers, sources = self.config, [], []
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: usable outside inference mode
            for layer in self.layers:
                a, m = layer.attn, layer.mlp
                wq, wk, wv = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
                norms = [layer.attn_norm.weight, layer.mlp_norm.weight]
                sources += [wq, wk, wv, a.o_proj.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
                sources += norms
                qkv_r = folded(norms[0], wq, wk, wv, rotated(wq, cfg.n_heads), rotated(wk, cfg.n_kv_heads))
                gate_up = folded(norms[1], m.gate_proj.weight, m.up_proj.weight)
                layers.append((qkv_r, a.o_proj.weight.t().contiguous(), gate_up, m.down_proj.weight.t().contiguous()))
            sources += [self.norm.weight, self.lm_head.weight, self.embed.weight]
            head = folded(self.norm.weight, self.lm_head.weight)
        stamp = tuple((p.data_ptr(), p._version) for p in sources)
        caches = []
        for layer in self.layers:
            cache = layer.attn.kv_cache
            assert cache is not None, "the cached path needs setup_caches()"
            caches.append((cache.k_cache, cache.v_cache))
        self._plan = _InferencePlan(sources, stamp, layers, head, caches)
        return self._plan

    def _cached_mask(
        self, input_pos: Tensor, attention_mask: Tensor | None, contiguous: bool, kv_len: int, last_row: bool
    ) -> Tensor | None:
        """Boolean SDPA mask over the filled prefix ``[:kv_len]`` for GQA-grouped query rows (row ``g*T + t``
        is query ``t``, see :func:`gqa_attention`); ``last_row``: the last query only. None when every query
        sees the whole prefix (one query at the last slot, no padding)."""
        T, groups = input_pos.shape[0], self.config.n_heads // self.config.n_kv_heads
        if attention_mask is None and contiguous:
            if T == 1 or last_row:
                return None
            return torch.cat([self.causal_mask[kv_len - T : kv_len, :kv_len]] * groups)  # (G*T, S): views, one copy
        mask = self._mask(T, input_pos, attention_mask)[..., :kv_len]  # (B|1, 1, T, S)
        if last_row:
            mask = mask[..., -1:, :]  # (B|1, 1, 1, S)
        return mask.repeat(1, 1, groups, 1)  # (B|1, 1, G*T, S)

    def _forward_cached(
        self, idx: Tensor, input_pos: Tensor, attention_mask: Tensor | None, last_only: bool = False
    ) -> Tensor:
        """Eager inference with the KV cache: the module path's math over the same parameters, with
        fewer ops (decode and short extends of a small model are bound by op dispatch, not FLOPs):

        - one host read of ``input_pos``; contiguous positions (every engine call) take RoPE rows and
          causal-mask rows as views, no index gather; masks are built outside the layer loop;
        - attend only the filled prefix ``[:kv_len]`` of the cache, not all ``S_max`` slots (later
          slots are masked anyway), and with no mask at all for one query without padding;
        - GQA by query grouping (:func:`gqa_attention`), never ``repeat_interleave`` of the cache;
        - four matmuls per layer over fused, pre-transposed weights with RoPE's rotation and the norm
          weights folded in (:meth:`_inference_plan`; state-dict names unchanged), residual adds fused
          into ``addmm``, no module calls;
        - ``last_only`` (prefill, extend): the last layer writes K/V for every row but computes attention,
          MLP and the LM head (the largest matmul) for the last row only; nothing reads the other rows' outputs.
        """
        cfg = self.config
        B, T = idx.shape
        assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
        H, n_kv, hd, d_eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model * cfg.norm_eps
        plan = self._inference_plan()
        positions = input_pos.tolist()  # the one host read per forward
        start = positions[0]
        contiguous = positions == list(range(start, start + T))
        kv_len = start + T if contiguous else max(positions) + 1
        if contiguous:  # views, no gather
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # (T, hd)
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (T, hd)
        # with ``last_only`` the last layer writes every row's K/V but computes the last row's output only
        last_layer = len(plan.layers) - 1 if last_only and T > 1 else -1
        mask = None if last_layer == 0 else self._cached_mask(input_pos, attention_mask, contiguous, kv_len, False)
        x = F.embedding(idx.reshape(-1), self.embed.weight)  # (B*T, d): 2-D rows for torch.mm
        cast = plan.caches[0][0].dtype != x.dtype
        for i, ((qkv_r_t, o_t, gate_up_t, down_t), (k_cache, v_cache)) in enumerate(zip(plan.layers, plan.caches)):
            qkv = torch.mm(_rms(x, d_eps), qkv_r_t)  # (B*T, (2H+3n_kv)*hd)
            # (B, heads, T, hd); with T == 1 the transpose is a plain view
            qkv = qkv.view(B, -1, 1, hd) if T == 1 else qkv.view(B, T, -1, hd).transpose(1, 2)
            qk, v, qk_rot = qkv.split_with_sizes([H + n_kv, n_kv, H + n_kv], dim=1)  # (B, heads, T, hd)
            qk = torch.addcmul(qk * cos, qk_rot, sin)  # RoPE on q and k: x * cos + rotate_half(x) * sin
            q, k = qk.split_with_sizes([H, n_kv], dim=1)  # (B, H, T, hd), (B, n_kv, T, hd)
            if k_cache.shape[0] != B:
                k_cache, v_cache = k_cache[:B], v_cache[:B]  # (B, n_kv, S_max, hd)
            k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype) if cast else k)
            v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype) if cast else v)
            k, v = k_cache.narrow(2, 0, kv_len), v_cache.narrow(2, 0, kv_len)  # (B, n_kv, S, hd)
            if cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if i == last_layer:  # nothing reads the other rows' outputs: one query row from here on
                q, x, T = q[:, :, -1:], x.view(B, T, -1)[:, -1], 1  # (B, H, 1, hd), (B, d)
                mask = self._cached_mask(input_pos, attention_mask, contiguous, kv_len, True)
            y = F.scaled_dot_product_attention(q.reshape(B, n_kv, -1, hd), k, v, attn_mask=mask)  # (B,n_kv,G*T,hd)
            # GQA by query grouping (see gqa_attention); one query row per head needs no transpose
            y = y.reshape(B, H * hd) if T == 1 else y.view(B, H, T, hd).transpose(1, 2).reshape(B * T, H * hd)
            x = torch.addmm(x, y, o_t)  # x + y @ o^T
            gate, up = torch.mm(_rms(x, d_eps), gate_up_t).chunk(2, dim=-1)  # (B*T, ffn) each
            x = torch.addmm(x, F.silu(gate) * up, down_t)  # (B*T, d)
        return torch.mm(_rms(x, d_eps), plan.head).view(B, T, -1)  # (B, T, V)

    def forward(
        self, idx: Tensor, input_pos: Tensor | None = None, attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:  # fmt: skip
        """Logits ``(B, T, V)``, or ``(B, 1, V)`` for the last position with ``last_only``.

        Args:
            idx: token ids ``(B, T)``.
            input_pos: positions ``(T,)`` to write into the KV cache (prefill: ``arange(T)``;
                decode: ``[pos]``). ``None`` runs without the cache (training).
            attention_mask: key validity, True = real token. Without cache ``(B, T)``; with cache
                ``(B, S_max)`` over cache slots.
            last_only: logits of the last position only (prefill needs no more); the cached path then
                also skips the last layer's attention and MLP for the other positions.
        """
        if input_pos is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._forward_cached(idx, input_pos, attention_mask, last_only)
        T = idx.shape[1]
        if input_pos is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # (T, hd)
        mask = self._mask(T, input_pos, attention_mask)
        x = self.embed(idx)  # (B, T, d)
        for layer in self.layers:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, input_pos, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, input_pos)
        if last_only:
            x = x[:, -1:]  # (B, 1, d)
        return self.lm_head(self.norm(x))  # (B, T, V)

    @torch.no_grad()
    def prefill(self, idx: Tensor, input_pos: Tensor | None = None, attention_mask: Tensor | None = None) -> Tensor:
        """Write the prompt into the cache; returns logits ``(B, T, V)``."""
        if input_pos is None:
            input_pos = torch.arange(idx.shape[1], device=idx.device)
        return self(idx, input_pos, attention_mask)

    @torch.no_grad()
    def decode(self, token: Tensor, input_pos: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """One step: ``token (B, 1)`` at ``input_pos (1,)``; returns logits ``(B, V)``."""
        return self(token, input_pos, attention_mask)[:, -1]


# --------------------------------------------------------------------------------------
# Checkpoints: the config travels with the weights


def model_fingerprint(model: Transformer) -> str:
    """sha256 over the config and the weights (order-stable)."""
    import hashlib

    h = hashlib.sha256(sha256_json(to_dict(model.config)).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def save_model(path: str | Path, model: Transformer, **extra: Any) -> str:
    """Atomically save config + weights (+ extra metadata) with a checksum sidecar."""
    payload = {"config": to_dict(model.config), "state_dict": model.state_dict(), **extra}
    return save_checksummed(payload, path)


def load_model(path: str | Path, map_location: str = "cpu") -> Transformer:
    """Rebuild the exact model from the checkpoint's own config (never a default)."""
    payload = load_checksummed(path, map_location=map_location)
    cfg = from_dict(ModelConfig, payload["config"], source=str(path), path="config")
    model = Transformer(cfg)
    model.load_state_dict(payload["state_dict"])
    return model


# --------------------------------------------------------------------------------------
# Hugging Face interop (weights both ways; built locally, nothing downloaded)

_HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def _hf_name(name: str) -> str:
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.{rest}
    return f"model.layers.{index}.{_HF_LAYER_NAMES[rest]}"


def hf_config(cfg: ModelConfig) -> Any:
    """The equivalent ``transformers.LlamaConfig``."""
    from transformers import LlamaConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta, "factor": s.factor}
        if s.kind == "llama3":
            rope |= {
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len,
            }
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """ModelConfig from a ``LlamaConfig``."""
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    scaling = None
    if rope.get("rope_type", "default") in ("linear", "llama3"):
        scaling = RopeScaling(
            kind=rope["rope_type"],
            factor=rope["factor"],
            low_freq_factor=rope.get("low_freq_factor", 1.0),
            high_freq_factor=rope.get("high_freq_factor", 4.0),
            original_max_seq_len=rope.get("original_max_position_embeddings", 8192),
        )
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size,
        d_model=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=hf_cfg.num_key_value_heads,
        ffn_hidden=hf_cfg.intermediate_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        head_dim=getattr(hf_cfg, "head_dim", None),
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
    )


def to_hf(model: Transformer) -> Any:
    """Copy weights into a new ``LlamaForCausalLM`` (same logits)."""
    from transformers import LlamaForCausalLM

    # transformers types PreTrainedModel.to (@wraps(Module.to)) as taking the model as its first argument
    hf = LlamaForCausalLM(hf_config(model.config)).to(model.embed.weight.dtype)  # type: ignore[arg-type]
    state = {_hf_name(k): v for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def from_hf(hf_model: Any) -> Transformer:
    """Build a :class:`Transformer` from a ``LlamaForCausalLM`` (same logits)."""
    model = Transformer(model_config_from_hf(hf_model.config)).to(hf_model.dtype)
    hf_state = hf_model.state_dict()
    state = {}
    for name in model.state_dict():
        hf_name = _hf_name(name)
        state[name] = hf_state[hf_name if hf_name in hf_state else "model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval()
