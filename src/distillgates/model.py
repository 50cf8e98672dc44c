"""Llama-style GQA decoder with a static KV cache (gpt-fast style).

Design choices:
- RMSNorm written by hand: ``nn.RMSNorm`` does not convert through ``torch.export`` to
  Core ML (the ``rms_norm`` op), see DESIGN.md "Platform facts".
- Real-valued RoPE with the Hugging Face ``rotate_half`` convention, so weights map 1:1 to
  ``LlamaForCausalLM`` (no q/k permutation) and no complex tensors reach the exporter.
- The KV cache is its own small module with pre-allocated ``(B, n_kv, S_max, hd)`` buffers
  written by index; the one ``forward`` serves training (no cache), prefill and one-token
  decode (``input_pos``). The engine's eager inference runs the same math with fused weights
  (``distillgates.runtime.decoder.FusedDecoder``); ``torch.compile`` and export trace this forward.
- Masks are boolean (True = may attend) and passed to SDPA: causal always, padded keys
  never attended, every query keeps at least its own position so no row is all ``-inf``.
- Module names follow Hugging Face Llama (``q_proj``, ``gate_proj``...) to keep the interop
  mapping (``distillgates.hf``) a rename table. Features of other families are config flags that
  default off (the toy model has none): q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), a
  ``head_dim`` other than ``d_model / n_heads`` (Qwen3, Mistral), and Gemma 3's scaled embeddings,
  GeGLU, norms after attention and the MLP, attention scale and sliding-window layers (each with its
  own mask and RoPE table). Gemma's RMSNorm multiplies by ``1 + w``: :mod:`distillgates.hf` stores
  ``1 + w`` as the weight, so one norm serves every family.

References: gpt-fast ``model.py``; HF ``modeling_llama.py``; Llama 3 RoPE scaling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

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


def rope_tables(cfg: ModelConfig, theta: float | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(max_seq_len, head_dim)`` in the HF duplicated-half layout (``theta``: another base, unscaled:
    Gemma 3's sliding layers)."""
    assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
    inv_freq = rope_inv_freq(cfg.head_dim, theta, None) if theta else rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                                                     cfg.rope_scaling)  # fmt: skip
    freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)  # (S, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd)
    return x * cos + rotate_half(x) * sin


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None) -> Tensor:
    """GQA without repeating the cache: the G query heads of one KV head are adjacent, so they attend
    the un-repeated K/V as G*T query rows (row ``g*T + t`` needs mask row ``t``: pass ``mask`` tiled
    G times, ``mask.repeat(1, 1, G, 1)``, or None when every key is visible).

    q ``(B, H, T, hd)``, k/v ``(B, n_kv, S, hd)``, mask ``(B|1, 1, G*T, S)`` -> ``(B, H, T, hd)``.
    """
    B, H, T, hd = q.shape
    qg = q.reshape(B, k.shape[1], -1, hd)  # (B, n_kv, G*T, hd)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale).view(B, H, T, hd)


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
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        # Qwen3: per-head RMSNorm of q and k (weights (hd,)) before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None  # None: SDPA's 1/sqrt(hd)
        self.kv_cache: KVCache | None = None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``(B, H, T, hd)``, k and v ``(B, n_kv, T, hd)`` before RoPE (``-1`` for T: no shape op in export)."""
        B = x.shape[0]
        q = self.q_proj(x).view(B, -1, self.n_heads, self.head_dim)  # (B, T, H, hd)
        k = self.k_proj(x).view(B, -1, self.n_kv_heads, self.head_dim)  # (B, T, n_kv, hd)
        v = self.v_proj(x).view(B, -1, self.n_kv_heads, self.head_dim)  # (B, T, n_kv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, n_kv, S_max, hd)
            k, v = k.to(q.dtype), v.to(q.dtype)
            groups = self.n_heads // self.n_kv_heads
            y = gqa_attention(q, k, v, mask.repeat(1, 1, groups, 1), self.scale)  # (B, H, T, hd)
        else:  # training: kept as is (fx-traceable for QAT)
            groups = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def gate_activation(x: Tensor, activation: str) -> Tensor:
    """The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
    return F.silu(x) if activation == "silu" else F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """SwiGLU, or GeGLU (``activation: gelu_tanh``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.activation = cfg.activation
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gate_activation(self.gate_proj(x), self.activation) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.residual_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.residual_norm_eps)
        self.mlp = FeedForward(cfg)
        # Gemma 3: the attention's and the MLP's outputs normed too, before the residual adds
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.sandwich_norm else None
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.sandwich_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor | None) -> Tensor:
        return self.add_mlp(self.add_attention(x, self.attn(self.attn_norm(x), cos, sin, mask, input_pos)))

    def add_attention(self, x: Tensor, a: Tensor) -> Tensor:
        """The residual stream ``x`` plus the attention's output ``a`` (Gemma: normed first)."""
        return x + (a if self.post_attn_norm is None else self.post_attn_norm(a))

    def add_mlp(self, h: Tensor) -> Tensor:
        """The residual stream ``h`` plus the MLP's output (Gemma: normed first)."""
        m = self.mlp(self.mlp_norm(h))
        return h + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


class Transformer(nn.Module):
    """Decoder-only LM. ``forward(idx, input_pos=None, attention_mask=None) -> logits``."""

    rope_cos: Tensor  # buffers, see __init__
    rope_sin: Tensor
    causal_mask: Tensor
    local_rope_cos: Tensor  # with sliding layers only
    local_rope_sin: Tensor
    local_causal_mask: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = cast("ModuleListOf[Block]", nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)))
        self.norm = RMSNorm(cfg.d_model, cfg.residual_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S_max, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S_max, hd)
        causal = torch.tril(torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)  # (S_max, S_max)
        if self.has_sliding_layers:
            assert cfg.sliding_window is not None  # ModelConfig.__post_init__
            cos, sin = rope_tables(cfg, cfg.rope_local_theta) if cfg.rope_local_theta else (cos, sin)
            self.register_buffer("local_rope_cos", cos, persistent=False)  # (S_max, hd)
            self.register_buffer("local_rope_sin", sin, persistent=False)
            band = torch.triu(causal, diagonal=1 - cfg.sliding_window)  # query i sees keys j with i - j < window
            self.register_buffer("local_causal_mask", band, persistent=False)  # (S_max, S_max)
        self.apply(self._init_weights)

    @property
    def has_sliding_layers(self) -> bool:
        return self.config.layer_types is not None and "sliding_attention" in self.config.layer_types

    @property
    def embed_multiplier(self) -> float:
        """What the token embeddings are multiplied by: Gemma's ``sqrt(d_model)``, times ``residual_scale``."""
        return (self.config.d_model**0.5 if self.config.embed_scale else 1.0) * self.config.residual_scale

    def embed_tokens(self, idx: Tensor) -> Tensor:
        """Token embeddings ``(B, T, d)`` times :attr:`embed_multiplier` (a Python float: traceable by fx, and in
        float32 the same product as HF's scale tensor)."""
        x, multiplier = self.embed(idx), self.embed_multiplier
        return x * multiplier if multiplier != 1.0 else x

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

    def remove_caches(self) -> None:
        for layer in self.layers:
            layer.attn.kv_cache = None

    def reset_caches(self) -> None:
        for layer in self.layers:
            if layer.attn.kv_cache is not None:
                layer.attn.kv_cache.reset()

    def make_mask(self, T: int, input_pos: Tensor | None, attention_mask: Tensor | None,
                  sliding: bool = False) -> Tensor:  # fmt: skip
        """Boolean mask (B or 1, 1, T, S): True where the query may attend the key (``sliding``: only the last
        ``sliding_window`` positions, its own included)."""
        causal = self.local_causal_mask if sliding else self.causal_mask
        # (T, T) without cache; (T, S_max) rows of the query positions with it
        mask = causal[:T, :T] if input_pos is None else causal[input_pos]
        mask = mask[None, None]  # (1, 1, T, S)
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
            own = torch.eye(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
            if input_pos is not None:
                own = F.one_hot(input_pos, mask.shape[-1]).bool()  # (T, S): each query's own slot
            # a padded key is never attended; a padded query keeps its own slot (no all -inf row)
            mask = mask & (keys | own[None, None])
        return mask

    def forward(
        self, idx: Tensor, input_pos: Tensor | None = None, attention_mask: Tensor | None = None,
        last_only: bool = False, split_head: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """Logits ``(B, T, V)``, or ``(B, 1, V)`` for the last position with ``last_only``; with ``split_head``
        the final hidden states ``(B, T, d)`` and the LM head's weight ``(V, d)`` instead, for a loss that applies
        the head itself a chunk at a time (:func:`distillgates.losses.position_stats`).

        Args:
            idx: token ids ``(B, T)``.
            input_pos: positions ``(T,)`` to write into the KV cache (prefill: ``arange(T)``;
                decode: ``[pos]``). ``None`` runs without the cache (training).
            attention_mask: key validity, True = real token. Without cache ``(B, T)``; with cache
                ``(B, S_max)`` over cache slots.
            last_only: logits of the last position only (prefill needs no more).
        """
        T, cfg = idx.shape[1], self.config
        rows = slice(0, T) if input_pos is None else input_pos
        inputs = {False: (self.rope_cos[rows], self.rope_sin[rows], self.make_mask(T, input_pos, attention_mask))}
        if self.has_sliding_layers:  # Gemma 3: their own RoPE table and mask
            inputs[True] = (self.local_rope_cos[rows], self.local_rope_sin[rows],
                            self.make_mask(T, input_pos, attention_mask, sliding=True))  # fmt: skip
        x = self.embed_tokens(idx)  # (B, T, d)
        for i, layer in enumerate(self.layers):
            cos, sin, mask = inputs[cfg.sliding(i)]  # (T, hd) x2, (B|1, 1, T, S)
            if cfg.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, input_pos, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, input_pos)
        if last_only:
            x = x[:, -1:]  # (B, 1, d)
        if split_head:
            return self.norm(x), self.lm_head.weight
        return self.lm_head(self.norm(x))  # (B, T, V)


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
