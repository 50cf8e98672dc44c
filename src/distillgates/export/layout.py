"""Two layouts of the same checkpoint for export: standard ``(B, T, C)`` and ANE ``(B, C, 1, S)``.

Design choices:
- Both layouts expose the same four steps (embed, project q/k/v, finish a block, LM head) so the
  export wrappers (:mod:`distillgates.export.wrappers`) own the KV-cache and attention logic once.
- The ANE layout follows apple/ml-ane-transformers: activations are ``(B, C, 1, S)`` (the ANE's
  native channels-first 4D layout, last axis contiguous), linears are 1x1 ``nn.Conv2d`` and
  RMSNorm reduces over the channel axis. One checkpoint serves both layouts: a load-state-dict
  pre-hook reshapes Linear weights ``(out, in) -> (out, in, 1, 1)``.
- RMSNorm keeps the fp32 accumulation of :class:`distillgates.model.RMSNorm` so both layouts
  are numerically equal in fp32.
- A vocabulary above the ANE's dimension limit (``ANE_MAX_DIM`` = 16384) gets an LM head split
  into ``ceil(V / 16384)`` near-equal chunks (:func:`head_widths`), each its own linear / 1x1 conv
  with its own weight, returned as separate tensors: no tensor on the path exceeds the limit (one
  concatenated output would). The runtime concatenates them in order (ANEMLL ships its LM heads
  the same way, as outputs ``logits1..logits16``). A vocabulary within the limit keeps the one
  head and the one ``logits`` output. The chunks are copies of the head's rows, so a tied
  embedding is stored twice when the head is split (the gather table and the chunks).

References: apple/ml-ane-transformers ``ane_transformers/reference``; "Deploying Transformers on
the Apple Neural Engine" (Apple ML research, 2022).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distillgates.config import ModelConfig
from distillgates.export.lint import ANE_MAX_DIM
from distillgates.model import Transformer, apply_rope, rope_tables

if TYPE_CHECKING:
    from distillgates.model import ModuleListOf


Logits = Tensor | tuple[Tensor, ...]  # (1, V), or its chunks (1, V_i) in vocabulary order


def head_widths(vocab_size: int) -> list[int]:
    """Output channels of each LM-head chunk: ``[V]`` within ``ANE_MAX_DIM``, else ``ceil(V / ANE_MAX_DIM)``
    near-equal chunks (the first ``V mod n`` one wider), each within the limit."""
    n = -(-vocab_size // ANE_MAX_DIM)
    return [vocab_size // n + (i < vocab_size % n) for i in range(n)]


def logits_names(vocab_size: int) -> list[str]:
    """Output names of the exported programs: ``logits``, or ``logits_0 .. logits_{n-1}`` for a split head."""
    n = len(head_widths(vocab_size))
    return ["logits"] if n == 1 else [f"logits_{i}" for i in range(n)]


class StandardLayout(nn.Module):
    """Adapter over :class:`Transformer`: activations ``(1, T, d)``.

    A split head (see :func:`head_widths`) is ``lm_head_chunks``: linears holding copies of the
    head's rows, so each chunk is a weight of its own in the package (quantized and read back
    like any linear weight).
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.config: ModelConfig = model.config
        widths = head_widths(model.config.vocab_size)
        chunks = model.lm_head.weight.detach().split(widths)  # (V_i, d) each
        self.lm_head_chunks = nn.ModuleList(_linear(rows) for rows in chunks) if len(widths) > 1 else None

    @property
    def rope(self) -> tuple[Tensor, Tensor]:
        return self.model.rope_cos, self.model.rope_sin  # (S_max, hd)

    @property
    def local_rope(self) -> tuple[Tensor, Tensor]:
        """The sliding layers' tables (Gemma 3; only a model with sliding layers has them)."""
        return self.model.local_rope_cos, self.model.local_rope_sin  # (S_max, hd)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.model.embed_tokens(ids)  # (1, T, d)

    def qkv(self, i: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        layer = self.model.layers[i]
        return layer.attn.project(layer.attn_norm(x))  # (1, H, T, hd), (1, n_kv, T, hd) x2

    def finish_block(self, i: int, x: Tensor, y: Tensor) -> Tensor:
        layer = self.model.layers[i]
        a = layer.attn.o_proj(y.transpose(1, 2).reshape(1, -1, self.config.n_heads * (self.config.head_dim or 0)))
        return layer.add_mlp(layer.add_attention(x, a))

    def select(self, x: Tensor, index: Tensor) -> Tensor:
        return x.index_select(1, index)  # (1, 1, d)

    def head(self, x: Tensor) -> Logits:
        """Logits ``(1, V)`` of a one-position activation (chunks ``(1, V_i)`` for a split head)."""
        h = self.model.norm(x)  # (1, 1, d)
        if self.lm_head_chunks is None:
            return self.model.lm_head(h).reshape(1, -1)
        return tuple(chunk(h).reshape(1, -1) for chunk in self.lm_head_chunks)  # (1, V_i) each


def _linear(rows: Tensor) -> nn.Linear:
    """A bias-free linear holding a copy of ``rows`` ``(out, in)``."""
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
    linear.weight.data.copy_(rows)
    return linear


class ANERMSNorm(nn.Module):
    """RMSNorm over the channel axis of ``(B, C, 1, S)``; fp32 accumulation like the standard one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps  # same eps as the checkpoint (the config keeps it >= 1e-6: fp16-safe)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + self.eps)  # (B, C, 1, S)
        return self.weight[None, :, None, None] * normed.to(x.dtype)


def _conv(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, bias=False)


class _ANEAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim or 0
        self.q_proj = _conv(cfg.d_model, cfg.n_heads * hd)
        self.k_proj = _conv(cfg.d_model, cfg.n_kv_heads * hd)
        self.v_proj = _conv(cfg.d_model, cfg.n_kv_heads * hd)
        self.o_proj = _conv(cfg.n_heads * hd, cfg.d_model)


class _ANEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = _conv(cfg.d_model, cfg.ffn_hidden)
        self.up_proj = _conv(cfg.d_model, cfg.ffn_hidden)
        self.down_proj = _conv(cfg.ffn_hidden, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _ANEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = ANERMSNorm(cfg.d_model, cfg.residual_norm_eps)
        self.attn = _ANEAttention(cfg)
        self.mlp_norm = ANERMSNorm(cfg.d_model, cfg.residual_norm_eps)
        self.mlp = _ANEFeedForward(cfg)


def _linear_to_conv_hook(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Reshape standard Linear weights ``(out, in)`` to 1x1 conv weights ``(out, in, 1, 1)``; split
    an LM head wider than the ANE limit into ``lm_head.{i}.weight`` chunks (:func:`head_widths`)."""
    for key, value in list(state_dict.items()):
        is_proj = key.endswith("_proj.weight") or key == f"{prefix}lm_head.weight"
        if key.startswith(prefix) and is_proj and value.dim() == 2:
            state_dict[key] = value[:, :, None, None]
    head = state_dict.get(f"{prefix}lm_head.weight")
    if head is not None and len(head_widths(head.shape[0])) > 1:
        del state_dict[f"{prefix}lm_head.weight"]
        for i, rows in enumerate(head.split(head_widths(head.shape[0]))):
            state_dict[f"{prefix}lm_head.{i}.weight"] = rows


class ANETransformer(nn.Module):
    """The :class:`Transformer` in ANE layout, loaded from the same state dict.

    Module names match the standard model, so ``load_state_dict(standard.state_dict())`` works
    through the pre-hook. Embedding and LM head are separate tensors here (a conv weight has a
    different shape), so tying is not kept: the export stores both. A split head is
    ``lm_head.0 .. lm_head.{n-1}``, 1x1 convs of :func:`head_widths` output channels.
    """

    rope_cos: Tensor  # buffers, see __init__
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        unsupported = [name for name in ("attention_bias", "qk_norm") if getattr(cfg, name)] + cfg.gemma_features()
        if unsupported:
            raise ValueError(f"export.layout 'ane' does not support {', '.join(unsupported)} yet; use layout: standard")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = cast("ModuleListOf[_ANEBlock]", nn.ModuleList(_ANEBlock(cfg) for _ in range(cfg.n_layers)))
        self.norm = ANERMSNorm(cfg.d_model, cfg.residual_norm_eps)
        chunks = [_conv(cfg.d_model, w) for w in head_widths(cfg.vocab_size)]
        self.lm_head: nn.Conv2d | nn.ModuleList = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S_max, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S_max, hd)
        self._register_load_state_dict_pre_hook(_linear_to_conv_hook)

    @classmethod
    def from_standard(cls, model: Transformer) -> ANETransformer:
        ane = cls(model.config)
        ane.load_state_dict(model.state_dict())
        return ane.to(model.embed.weight.dtype)

    @property
    def rope(self) -> tuple[Tensor, Tensor]:
        return self.rope_cos, self.rope_sin

    @property
    def local_rope(self) -> tuple[Tensor, Tensor]:
        return self.rope  # no sliding layers here (refused with Gemma 3's other features)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.embed(ids).transpose(1, 2).unsqueeze(2)  # (1, d, 1, T)

    def qkv(self, i: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cfg, layer = self.config, self.layers[i]
        h = layer.attn_norm(x)  # (1, d, 1, T)
        q = layer.attn.q_proj(h).view(1, cfg.n_heads, cfg.head_dim, -1).transpose(2, 3)  # (1, H, T, hd)
        k = layer.attn.k_proj(h).view(1, cfg.n_kv_heads, cfg.head_dim, -1).transpose(2, 3)  # (1, n_kv, T, hd)
        v = layer.attn.v_proj(h).view(1, cfg.n_kv_heads, cfg.head_dim, -1).transpose(2, 3)  # (1, n_kv, T, hd)
        return q, k, v

    def finish_block(self, i: int, x: Tensor, y: Tensor) -> Tensor:
        layer = self.layers[i]
        y = y.transpose(2, 3).reshape(1, self.config.n_heads * (self.config.head_dim or 0), 1, -1)  # (1, H*hd, 1, T)
        h = x + layer.attn.o_proj(y)  # (1, d, 1, T)
        return h + layer.mlp(layer.mlp_norm(h))

    def select(self, x: Tensor, index: Tensor) -> Tensor:
        return x.index_select(3, index)  # (1, d, 1, 1)

    def head_chunks(self, x: Tensor) -> list[Tensor]:
        """Logits ``(1, V_i, 1, S)`` per head chunk of ``(1, d, 1, S)`` (one chunk: the whole head)."""
        h = self.norm(x)
        return [self.lm_head(h)] if isinstance(self.lm_head, nn.Conv2d) else [conv(h) for conv in self.lm_head]

    def head(self, x: Tensor) -> Logits:
        chunks = [c.reshape(1, -1) for c in self.head_chunks(x)]  # (1, V_i) each
        return chunks[0] if len(chunks) == 1 else tuple(chunks)  # (1, V)

    def forward(self, idx: Tensor) -> Tensor:
        """Cache-free logits ``(1, T, V)`` (batch 1), for parity with ``Transformer.forward``."""
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(idx)
        groups = self.config.n_heads // self.config.n_kv_heads
        for i in range(self.config.n_layers):
            q, k, v = self.qkv(i, x)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (1, H, T, hd)
            x = self.finish_block(i, x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return torch.cat(self.head_chunks(x), 1).squeeze(2).transpose(1, 2)  # (1, T, V)


def build_layout(model: Transformer, layout: str) -> StandardLayout | ANETransformer:
    """The export adapter for ``layout`` ("standard" or "ane"), sharing ``model``'s weights."""
    if layout == "standard":
        return StandardLayout(model)
    if layout == "ane":
        return ANETransformer.from_standard(model)
    raise ValueError(f"layout must be 'standard' or 'ane', got {layout!r}")
