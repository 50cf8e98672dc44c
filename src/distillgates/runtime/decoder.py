"""Fused eager decoder over a :class:`~distillgates.model.Transformer` and its static KV cache.

``Transformer.forward`` is the one model forward (training, and prefill/decode through
``input_pos``). :class:`FusedDecoder` computes the same logits over the same parameters and
cache buffers with fewer ops: decode and short extends of a small model are bound by op
dispatch, not FLOPs. The PyTorch engine runs it eagerly, except a large model's one-row decode step,
which it compiles (below); ``torch.compile`` and ``torch.export`` of the model trace its own forward.

Design choices (measured in docs/benchmarks.md section 1):
- four matmuls per layer over fused, pre-transposed weights (``x @ W^T`` with a contiguous
  ``W^T`` is the fast one-row matmul on CPU; the down projection keeps the model's own layout for
  ``addmv``), residual adds fused into ``addmm``/``addmv``, no module calls;
- each RMSNorm weight folded into the matmul that follows it, and for small models RoPE's
  ``rotate_half`` folded into the QKV weight (:meth:`FusedDecoder.plan`); larger models flip the
  halves of q and k instead (one op per layer): the folded rows make the QKV weight 1.8x larger
  (SmolLM-135M) and decode at that size is bound by weight reads (docs/benchmarks.md section 8);
- one host read of ``input_pos``; contiguous positions (every engine call) take RoPE and
  causal-mask rows as views; attention over the filled prefix ``[:kv_len]`` only, with no mask
  at all for one query without padding;
- GQA by query grouping (:func:`~distillgates.model.gqa_attention`), never ``repeat_interleave``
  of the cache;
- a model bound by weight reads decodes one row in one step compiled by inductor, its matmuls as
  reductions over the weight rows: twice the read bandwidth of MKL's one-row kernels on CPU
  (docs/benchmarks.md section 8); several rows run oneDNN over packed weights;
- the optional features of other families: q/k/v biases (Qwen2) become one ``addmm`` bias (rotated
  like the weights); per-head q/k RMSNorm (Qwen3, Gemma 3) runs after the matmul, on ``R q`` with its weight
  halves swapped (``rotate_half(w * q) == swap(w) * rotate_half(q)``, and the norm of ``R q`` is that of ``q``);
  Gemma 3's norms after attention and the MLP run on the matmul's output before the residual add (no fused add
  there), its sliding layers take their own RoPE rows and window masks (the compiled one-row step narrows the
  cache to the window instead of masking).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
from typing import Any, Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from distillgates.model import Transformer, gate_activation


def _rms(x: Tensor, d_eps: float) -> Tensor:
    """``rms_norm(x) / sqrt(d)`` without its weight: ``x * rsqrt(sum(x^2) + d * eps)``. The plan folds
    ``weight * sqrt(d)`` into the next matmul (``sum`` is one op, ``mean`` two)."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + d_eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + d_eps)).to(x.dtype)


# A model whose weights take at most this many bytes fits a last-level cache and its decode is bound by
# op dispatch: the plan folds rotate_half into the QKV weight (an extra op per layer costs more than the
# extra rows). A larger one is bound by weight reads: the plan keeps the QKV weight small (the folded rows
# make it 1.8x larger) and runs the kernels that read weights fastest (see FusedDecoder's ``matmuls``).
DISPATCH_BOUND_MAX_BYTES = 16 * 2**20


def packed_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's inner product over pre-packed weights (``torch.ops.mkldnn._linear_pointwise``,
    what inductor's CPU freezing runs) serves ``dtype`` weights on ``device``: float32 on a CPU build with
    oneDNN. Measured at the SmolLM-135M shape (docs/benchmarks.md section 8): on two threads its one-row
    matmuls read faster than MKL's (which gain nothing from a second thread), on one thread slower; over
    several rows (batched decode, prefill) it is faster on both, as MKL repacks the weight at every call."""
    return (dtype == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))  # fmt: skip


def compiled_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether inductor can compile the one-row matmuls (:data:`MATMULS` ``"compiled"``): float32 on a CPU
    with the C++ compiler inductor uses (``$CXX``, else ``g++``; ``clang++`` on macOS)."""
    compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    return dtype == torch.float32 and device.type == "cpu" and shutil.which(compiler) is not None


def _attn_in(x: Tensor, w: Tensor, bias: Tensor | None, d_eps: float) -> Tensor:
    """One row ``(1, d)``: ``rms(x) @ W^T (+ bias)`` as a reduction over ``W``'s rows ``(out, d)``."""
    out = (w * _rms(x, d_eps)).sum(-1)
    return (out if bias is None else out + bias).view(1, -1)


def _layer_out(y: Tensor, x: Tensor, layer: _Layer, d_eps: float, activation: str) -> Tensor:
    """One row: the residual stream after attention output ``y``: ``x + o y``, then ``+`` its MLP, every
    matmul a reduction over the weight's rows (``o`` ``(d, H*hd)``, ``gate_up`` ``(2 ffn, d)``, ``down``
    ``(d, ffn)``); Gemma's post norms on both before the adds."""
    a = (layer.o * y).sum(-1)
    x = x + (a if layer.post is None else _rms(a, d_eps) * layer.post[0])
    gate, up = (layer.gate_up * _rms(x, d_eps)).sum(-1).chunk(2)
    m = (layer.down * (gate_activation(gate, activation) * up)).sum(-1)
    return x + (m if layer.post is None else _rms(m, d_eps) * layer.post[1])


def _mkl_linear(x: Tensor, w_t: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W^T (+ bias)`` over a contiguous ``W^T``: MKL's fast one-row matmul."""
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W^T (+ bias)`` over oneDNN's packed ``W`` (``torch.ops.mkldnn._reorder_linear_weight``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_add(x: Tensor, packed: Tensor, residual: Tensor) -> Tensor:
    """``residual + x @ W^T`` over oneDNN's packed ``W``: the add is the kernel's post-op."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")


# How the plan lays out each weight and which kernels run the matmuls (FusedDecoder's ``matmuls``):
# "mkl": ``x @ W^T`` over a contiguous ``W^T`` (MKL); "packed": oneDNN over its packed ``W``; "compiled": ``W``
# as rows ``(out, in)``; one row over a one-row cache runs the whole step compiled by inductor (:func:`_decode_step`,
# its matmuls as reductions over the rows, which read weights about twice as fast as MKL's one-row kernels),
# several rows ``x @ W^T`` (MKL).
Matmuls = Literal["mkl", "packed", "compiled"]
MATMULS: tuple[Matmuls, ...] = get_args(Matmuls)


class _Layer(NamedTuple):
    qkv_r: Tensor  # rows [q; k; v; R q; R k] (or [q; k; v] unfolded), attention norm folded in; see Matmuls
    o: Tensor  # o^T (H*hd, d) contiguous (mkl), packed o, or the model's own (d, H*hd) (compiled)
    gate_up: Tensor  # rows [gate; up], MLP norm folded in; see Matmuls
    down: Tensor  # (d, ffn): the model's own weight, not transposed (mkl: see forward; compiled), or packed down
    qkv_r_bias: Tensor | None  # biases of the rows of qkv_r (attention_bias)
    qk_norm: tuple[Tensor, Tensor] | None  # (H+n_kv, 1, hd) weights for [q; k] and [R q; R k] (qk_norm)
    post: tuple[Tensor, Tensor] | None  # Gemma's post-attention and post-MLP norm weights times sqrt(d) (see _rms)
    sliding: bool  # Gemma 3: attends the last sliding_window positions, with the local RoPE table


class _Plan(NamedTuple):
    sources: list[Tensor]  # the parameters the fused tensors were built from
    stamp: tuple[tuple[int, int], ...]  # (data_ptr, _version) of each source at build time
    matmuls: Matmuls
    layers: list[_Layer]
    head: Tensor  # lm_head with the final norm folded in; see Matmuls
    rope_sin: Tensor  # (S_max, hd): the model's sin table; unfolded rotation: first half negated
    local_rope_sin: Tensor | None  # the same of the sliding layers' table (Gemma 3)


def _heads(
    qkv: Tensor, B: int, T: int, dims: tuple[int, int, int, float], fold: bool, qk_norm: tuple[Tensor, Tensor] | None,
    cos: Tensor, sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` ``(B, heads, T, hd)`` of the QKV matmul's output ``(B*T, rows)`` (see :meth:`FusedDecoder.plan`),
    q and k RoPE-rotated (and per-head RMS-normed first with ``qk_norm``)."""
    H, n_kv, hd, norm_eps = dims
    # (B, heads, T, hd); with T == 1 the transpose is a plain view
    qkv = qkv.view(B, -1, 1, hd) if T == 1 else qkv.view(B, T, -1, hd).transpose(1, 2)
    if fold:
        qk, v, qk_rot = qkv.split_with_sizes([H + n_kv, n_kv, H + n_kv], dim=1)  # (B, heads, T, hd)
    else:
        (qk, v), qk_rot = qkv.split_with_sizes([H + n_kv, n_kv], dim=1), None  # (B, heads, T, hd)
    if qk_norm is not None:  # per-head RMSNorm of q and k (Qwen3), fp32 accumulation as RMSNorm
        qk32 = qk.float()
        inv_rms = torch.rsqrt(qk32.pow(2).mean(-1, keepdim=True) + norm_eps)  # (B, H+n_kv, T, 1)
        qk = qk_norm[0] * (qk32 * inv_rms).to(qk.dtype)
        if qk_rot is not None:
            qk_rot = qk_norm[1] * (qk_rot.float() * inv_rms).to(qk.dtype)
    if qk_rot is None:  # halves swapped; rotate_half's sign is in sin (the plan's rope_sin)
        qk_rot = qk.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)  # (B, H+n_kv, T, hd)
    qk = torch.addcmul(qk * cos, qk_rot, sin)  # RoPE on q and k: x * cos + rotate_half(x) * sin
    q, k = qk.split_with_sizes([H, n_kv], dim=1)  # (B, H, T, hd), (B, n_kv, T, hd)
    return q, k, v


class _Features(NamedTuple):
    """What the layers compute beyond Llama's (Gemma 3), fixed per model."""

    scale: float | None  # attention scale (None: 1/sqrt(head_dim))
    activation: str  # silu | gelu_tanh
    window: int  # sliding layers attend keys less than this many positions back (0: no sliding layer)


def _decode_layer(
    x: Tensor, layer: _Layer, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor, kv_len: int, cos: Tensor,
    sin: Tensor, dims: tuple[int, int, int, float], fold: bool, d_eps: float, features: _Features,
) -> Tensor:
    """One layer of one row ``x`` ``(1, d)`` at ``input_pos`` ``[pos]`` (the last filled slot, ``kv_len - 1``) over a
    one-row cache: the residual stream after it, every matmul a reduction over the weight's rows (``Matmuls``
    ``"compiled"``). A sliding layer attends the window's keys only: the last ``window`` slots, no mask needed."""
    q, k, v = _heads(_attn_in(x, layer.qkv_r, layer.qkv_r_bias, d_eps), 1, 1, dims, fold, layer.qk_norm, cos, sin)
    k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype))
    v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype))
    start = max(0, kv_len - features.window) if layer.sliding else 0
    k, v = k_cache.narrow(2, start, kv_len - start).to(q.dtype), v_cache.narrow(2, start, kv_len - start).to(q.dtype)
    H, n_kv, hd, _ = dims
    y = F.scaled_dot_product_attention(q.reshape(1, n_kv, -1, hd), k, v, scale=features.scale)  # GQA by grouping
    return _layer_out(y.reshape(1, H * hd), x, layer, d_eps, features.activation)


def _decode_step(
    x: Tensor, layers: list[_Layer], caches: list[tuple[Tensor, Tensor]], input_pos: Tensor, kv_len: int,
    rope: tuple[Tensor, Tensor, Tensor | None, Tensor | None], dims: tuple[int, int, int, float], fold: bool,
    d_eps: float, head: Tensor, features: _Features,
) -> Tensor:
    """Logits ``(1, V)`` of one row ``x`` through every layer (:func:`_decode_layer`) and the LM head: compiled
    as one graph, one call per token (a call per layer cost 7-8% more time per token at SmolLM-135M). ``rope``:
    cos and sin rows of the global and (Gemma 3) the sliding layers."""
    for layer, (k_cache, v_cache) in zip(layers, caches):
        cos, sin = (rope[2], rope[3]) if layer.sliding else (rope[0], rope[1])
        assert cos is not None and sin is not None
        x = _decode_layer(x, layer, k_cache, v_cache, input_pos, kv_len, cos, sin, dims, fold, d_eps, features)
    return _attn_in(x, head, None, d_eps)


@functools.cache
def _compiled_step() -> Any:
    """:func:`_decode_step` compiled by inductor, once per process (imports dynamo on first use only). Its
    kernels read the thread count at run time (``cpp.dynamic_threads``): a process may change it later."""
    return torch.compile(_decode_step, options={"cpp.dynamic_threads": True})


class FusedDecoder:
    """Inference forward with the KV cache over ``model``'s parameters and cache buffers.

    Build it after ``model.setup_caches``: it writes those buffers for its whole life (after another
    ``setup_caches``, build a new decoder). Call it under ``torch.inference_mode`` or ``no_grad``.

    Args:
        model: the transformer, with its static cache set up.
        fold_rotation: fold RoPE's ``rotate_half`` into the QKV weight (see :meth:`plan`); default:
            while the model's weights take at most ``DISPATCH_BOUND_MAX_BYTES``.
        matmuls: the kernels of the matmuls (:data:`Matmuls`); default: ``"mkl"`` while the model's weights
            take at most ``DISPATCH_BOUND_MAX_BYTES``; for a larger one, ``"packed"`` when the cache holds more
            than one row (and :func:`packed_available`), else ``"compiled"`` (when :func:`compiled_available`),
            else ``"packed"`` while torch runs more than one thread and ``"mkl"`` on one (checked at each
            forward: the plan is rebuilt when the thread count changes).

    Raises:
        ValueError: the model has no KV cache, or ``matmuls`` this build or machine cannot run.
    """

    def __init__(self, model: Transformer, fold_rotation: bool | None = None, matmuls: Matmuls | None = None) -> None:
        caches = [layer.attn.kv_cache for layer in model.layers]
        if model.config.residual_scale != 1.0:
            raise ValueError("FusedDecoder: residual_scale (the export's fp16 scaling) is not for the engine; decode "
                             "the unscaled model")  # fmt: skip
        if any(cache is None for cache in caches):
            raise ValueError("FusedDecoder needs the model's KV cache: call model.setup_caches(batch) first")
        self.model = model
        self.config = cfg = model.config
        window = (cfg.sliding_window or 0) if model.has_sliding_layers else 0
        self.features = _Features(cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
                                  cfg.activation, window)  # fmt: skip
        dispatch_bound = sum(p.numel() * p.element_size() for p in model.parameters()) <= DISPATCH_BOUND_MAX_BYTES
        self.fold_rotation = dispatch_bound if fold_rotation is None else fold_rotation
        weight = model.embed.weight
        can_pack = packed_available(weight.dtype, weight.device)
        can_compile = compiled_available(weight.dtype, weight.device)
        if matmuls == "packed" and not can_pack:
            raise ValueError(f"oneDNN packed weights need float32 on a CPU build with oneDNN; got {weight.dtype} "
                             f"on {weight.device}")  # fmt: skip
        if matmuls == "compiled" and not can_compile:
            raise ValueError(f"compiled matmuls need float32 on a CPU with a C++ compiler for inductor; got "
                             f"{weight.dtype} on {weight.device}")  # fmt: skip
        self.caches = [(c.k_cache, c.v_cache) for c in caches if c is not None]  # per layer, (B_max, n_kv, S_max, hd)
        if matmuls is None and (dispatch_bound or not (can_pack or can_compile)):
            matmuls = "mkl"
        elif matmuls is None and self.caches[0][0].shape[0] > 1:  # batched decode
            matmuls = "packed" if can_pack else "mkl"
        elif matmuls is None and can_compile:
            matmuls = "compiled"
        self.matmuls = matmuls  # None: packed while torch runs more than one thread (decided at each plan())
        self._plan: _Plan | None = None
        # a load_state_dict(assign=True) replaces Parameter objects, which the stamp cannot see
        model.register_load_state_dict_post_hook(self._drop_plan_hook)

    def _drop_plan_hook(self, _module: Any, _incompatible_keys: Any) -> None:
        self.drop_plan()

    def drop_plan(self) -> None:
        """Free the fused weights (rebuilt on the next forward)."""
        self._plan = None

    def plan(self) -> _Plan:
        """The model's weights folded so that each layer is four matmuls:

        - per layer ``(qkv_r, o, gate_up, down)``, then ``head``, laid out for their kernels (:data:`Matmuls`):
          packed for oneDNN; rows ``(out, in)`` for compiled reductions (``o`` and ``down`` the model's own
          weights, no copy); for MKL transposed contiguous (``x @ W^T`` with a contiguous ``W^T`` is MKL's fast
          one-row matmul on CPU) except ``down``: the model's own ``(d, ffn)`` weight, no copy (one row:
          ``addmv`` over it is the faster one for an output narrower than the input, at the SmolLM-135M shape
          1.2x; more rows: ``W^T`` as a view);
        - ``qkv_r`` = rows ``[q; k; v; R q; R k]`` where ``R`` is RoPE's ``rotate_half`` (a signed
          permutation of rows, so ``R W x`` is exactly ``rotate_half(W x)``): RoPE is then 3 elementwise ops.
          Without ``fold_rotation`` the rows are ``[q; k; v]`` and the forward flips the halves of q and k,
          with ``rotate_half``'s sign moved into the plan's ``rope_sin``;
        - each RMSNorm weight (times ``sqrt(d)``, see :func:`_rms`) is folded into the columns of the
          matmul that follows it (``(w * n) @ W^T == n @ (w * W)^T`` up to float rounding).

        One extra copy of the linear weights, kept while every source parameter keeps its storage and
        version (in-place updates and ``.to()`` are seen; ``load_state_dict`` drops it; after replacing
        a Parameter object otherwise, call :meth:`drop_plan`).
        """
        plan, matmuls = self._plan, self.matmuls or ("packed" if torch.get_num_threads() > 1 else "mkl")
        stamp = None if plan is None else tuple((p.data_ptr(), p._version) for p in plan.sources)
        if plan is not None and plan.matmuls == matmuls and plan.stamp == stamp:
            return plan
        self._plan = None  # free the old copy before building the new one
        cfg = self.config
        assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
        half, fold = cfg.head_dim // 2, self.fold_rotation

        def rotated(w: Tensor, heads: int) -> Tensor:  # rows of rotate_half(w @ x), per head
            w = w.view(heads, 2, half, -1)
            return torch.cat([-w[:, 1], w[:, 0]], dim=1).reshape(heads * 2 * half, -1)

        def swapped(w: Tensor) -> Tensor:  # rotate_half(w * q) == swapped(w) * rotate_half(q)
            return torch.cat([w[half:], w[:half]])

        def laid_out(w: Tensor) -> Tensor:  # (out, in) -> packed (oneDNN), rows (compiled), or W^T contiguous
            if matmuls == "packed":
                return torch.ops.mkldnn._reorder_linear_weight(w)
            return w.detach() if matmuls == "compiled" else w.t().contiguous()

        def folded(norm: Tensor, *ws: Tensor) -> Tensor:  # rows ws with the norm weight folded in, laid out
            return laid_out((torch.cat(ws).float() * (norm.float() * math.sqrt(cfg.d_model))).to(ws[0].dtype))

        model, layers, sources = self.model, [], []
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: usable outside inference mode
            for i, layer in enumerate(model.layers):
                a, m = layer.attn, layer.mlp
                wq, wk, wv = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
                norms = [layer.attn_norm.weight, layer.mlp_norm.weight]
                sources += [wq, wk, wv, a.o_proj.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
                sources += norms
                rows = [wq, wk, wv] + ([rotated(wq, cfg.n_heads), rotated(wk, cfg.n_kv_heads)] if fold else [])
                qkv_r = folded(norms[0], *rows)
                gate_up = folded(norms[1], m.gate_proj.weight, m.up_proj.weight)
                bias = qk_norm = None
                if a.q_proj.bias is not None and a.k_proj.bias is not None and a.v_proj.bias is not None:
                    bq, bk, bv = a.q_proj.bias, a.k_proj.bias, a.v_proj.bias
                    sources += [bq, bk, bv]
                    rotated_bias = [rotated(bq[:, None], cfg.n_heads)[:, 0], rotated(bk[:, None], cfg.n_kv_heads)[:, 0]]
                    bias = torch.cat([bq, bk, bv] + (rotated_bias if fold else []))
                if a.q_norm is not None and a.k_norm is not None:
                    wqn, wkn = a.q_norm.weight, a.k_norm.weight
                    sources += [wqn, wkn]
                    heads = (wqn,) * cfg.n_heads + (wkn,) * cfg.n_kv_heads  # per head of [q; k]
                    qk_norm = (torch.stack(heads)[:, None], torch.stack([swapped(w) for w in heads])[:, None])
                down = m.down_proj.weight.detach() if matmuls == "mkl" else laid_out(m.down_proj.weight)
                post = None
                if layer.post_attn_norm is not None and layer.post_mlp_norm is not None:  # Gemma: normed outputs
                    sources += [layer.post_attn_norm.weight, layer.post_mlp_norm.weight]
                    post = (layer.post_attn_norm.weight.detach() * math.sqrt(cfg.d_model),
                            layer.post_mlp_norm.weight.detach() * math.sqrt(cfg.d_model))  # fmt: skip
                layers.append(_Layer(qkv_r, laid_out(a.o_proj.weight), gate_up, down, bias, qk_norm, post,
                                     cfg.sliding(i)))  # fmt: skip
            sources += [model.norm.weight, model.lm_head.weight, model.embed.weight]
            head = folded(model.norm.weight, model.lm_head.weight)
            sign = torch.ones(cfg.head_dim, dtype=model.rope_sin.dtype, device=model.rope_sin.device)
            sign.index_fill_(0, torch.arange(half), -1.0)
            rope_sin = model.rope_sin if fold else model.rope_sin * sign
            local_sin = None
            if model.has_sliding_layers:
                local_sin = model.local_rope_sin if fold else model.local_rope_sin * sign
        stamp = tuple((p.data_ptr(), p._version) for p in sources)
        self._plan = _Plan(sources, stamp, matmuls, layers, head, rope_sin, local_sin)
        return self._plan

    def _mask(self, input_pos: Tensor, contiguous: bool, kv_len: int, last_row: bool,
              sliding: bool = False) -> Tensor | None:  # fmt: skip
        """Boolean SDPA mask over the filled prefix ``[:kv_len]`` for GQA-grouped query rows (row ``g*T + t``
        is query ``t``, see :func:`~distillgates.model.gqa_attention`); ``last_row``: the last query only;
        ``sliding``: a sliding layer's (Gemma 3). None when every query sees the whole prefix (one query at the
        last slot, within the window)."""
        T, groups = input_pos.shape[-1], self.config.n_heads // self.config.n_kv_heads
        table = self.model.local_causal_mask if sliding else self.model.causal_mask
        if input_pos.dim() == 2:  # one position row per batch row: causal in each row's own positions
            mask = table[input_pos][:, None, :, :kv_len]  # (B, 1, T, S)
            return (mask[..., -1:, :] if last_row else mask).repeat(1, 1, groups, 1)  # (B, 1, G*T | G, S)
        if contiguous:
            if (T == 1 or last_row) and not (sliding and kv_len > self.features.window):
                return None
            causal = table[kv_len - (1 if last_row else T) : kv_len, :kv_len]  # (T | 1, S): a view
            return torch.cat([causal] * groups)  # (G*T | G, S): one copy
        mask = self.model.make_mask(T, input_pos, None, sliding)[..., :kv_len]  # (1, 1, T, S)
        if last_row:
            mask = mask[..., -1:, :]  # (1, 1, 1, S)
        return mask.repeat(1, 1, groups, 1)  # (1, 1, G*T, S)

    def forward(
        self, idx: Tensor, input_pos: Tensor, last_only: bool = False, cache_rows: Tensor | None = None
    ) -> Tensor:
        """Write ``idx`` into the cache at ``input_pos``; logits as ``Transformer.forward`` returns them.

        Args:
            idx: token ids ``(B, T)``.
            input_pos: cache positions ``(T,)`` (prefill: ``arange(T)``; decode: ``[pos]``), shared by the
                rows; or ``(B, T)``, each row's own (continuous batching: a row attends its slots up to each
                query's position, so slots past it may hold anything).
            cache_rows: with per-row positions, the cache row of each batch row ``(B,)`` (default: rows
                ``0..B-1``); other rows are neither read nor written.
            last_only: logits ``(B, 1, V)`` of the last position only (prefill, extend): the last layer
                writes K/V for every row but computes attention, MLP and the LM head (the largest
                matmul) for the last row only; nothing reads the other rows' outputs.

        Returns:
            Logits ``(B, T, V)``, or ``(B, 1, V)`` with ``last_only``.
        """
        cfg, model = self.config, self.model
        B, T = idx.shape
        assert cfg.head_dim is not None  # set by ModelConfig.__post_init__
        H, n_kv, hd, d_eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model * cfg.norm_eps
        plan = self.plan()
        packed, compiled = plan.matmuls == "packed", plan.matmuls == "compiled"
        linear = _packed_linear if packed else F.linear if compiled else _mkl_linear
        per_row = input_pos.dim() == 2
        positions = input_pos.tolist()  # the one host read per forward
        tables = [(model.rope_cos, plan.rope_sin)]  # the global layers' RoPE, then the sliding layers' (Gemma 3)
        if plan.local_rope_sin is not None:
            tables.append((model.local_rope_cos, plan.local_rope_sin))
        if per_row:
            contiguous, kv_len = False, max(map(max, positions)) + 1
            rope = [(c[input_pos][:, None], s[input_pos][:, None]) for c, s in tables]  # (B, 1, T, hd) each
            if cache_rows is None or cache_rows.tolist() == list(range(B)):
                gather, rows = False, torch.arange(B, device=idx.device)[:, None]  # (B, 1): the first B rows
            else:
                gather, rows = True, cache_rows[:, None]  # (B, 1): another subset of the cache rows
        else:
            start = positions[0]
            contiguous = positions == list(range(start, start + T))
            kv_len = start + T if contiguous else max(positions) + 1
            if contiguous:  # views, no gather
                rope = [(c[start : start + T], s[start : start + T]) for c, s in tables]  # (T, hd) each
            else:
                rope = [(c[input_pos], s[input_pos]) for c, s in tables]  # (T, hd) each
        # with ``last_only`` the last layer writes every row's K/V but computes the last row's output only
        last_layer = len(plan.layers) - 1 if last_only and T > 1 else -1
        masks = [None if last_layer == 0 else self._mask(input_pos, contiguous, kv_len, False, sliding)
                 for sliding in (False, True)[: len(tables)]]  # fmt: skip
        x = F.embedding(idx.reshape(-1), model.embed.weight)  # (B*T, d): 2-D rows for torch.mm
        if (multiplier := model.embed_multiplier) != 1.0:  # Gemma, fp16 headroom (as Transformer.embed_tokens)
            x = x * multiplier
        cast = self.caches[0][0].dtype != x.dtype
        feats = self.features
        if compiled and B * T == 1 and self.caches[0][0].shape[0] == 1:  # one row over a one-row cache
            pos, dims = input_pos.view(1), (H, n_kv, hd, cfg.norm_eps)
            flat = [t.view(1, hd) for pair in rope for t in pair]
            rows_rope = (flat[0], flat[1], flat[2] if len(flat) > 2 else None, flat[3] if len(flat) > 2 else None)
            logits = _compiled_step()(x, plan.layers, self.caches, pos, kv_len, rows_rope, dims,
                                      self.fold_rotation, d_eps, plan.head, feats)  # fmt: skip
            return logits.view(1, 1, -1)  # (1, 1, V)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(plan.layers, self.caches)):
            qkv_r, o, gate_up, down, qkv_r_bias, qk_norm, post, sliding = layer
            (cos, sin), mask = rope[sliding], masks[sliding]
            qkv = linear(_rms(x, d_eps), qkv_r, qkv_r_bias)  # (B*T, (2H+3n_kv)*hd)
            q, k, v = _heads(qkv, B, T, (H, n_kv, hd, cfg.norm_eps), self.fold_rotation, qk_norm, cos, sin)
            if per_row:  # (B_max, S, n_kv, hd) views of the cache, written at (cache row, its position)
                k_cache.transpose(1, 2)[rows, input_pos] = (k.to(k_cache.dtype) if cast else k).transpose(1, 2)
                v_cache.transpose(1, 2)[rows, input_pos] = (v.to(v_cache.dtype) if cast else v).transpose(1, 2)
            if per_row and gather:  # another subset of the rows than the first B: a copy of theirs
                k, v = k_cache[rows[:, 0], :, :kv_len], v_cache[rows[:, 0], :, :kv_len]  # (B, n_kv, S, hd)
            else:
                if k_cache.shape[0] != B:
                    k_cache, v_cache = k_cache[:B], v_cache[:B]  # (B, n_kv, S_max, hd)
                if not per_row:
                    k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype) if cast else k)
                    v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype) if cast else v)
                k, v = k_cache.narrow(2, 0, kv_len), v_cache.narrow(2, 0, kv_len)  # (B, n_kv, S, hd)
            if cast:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if i == last_layer:  # nothing reads the other rows' outputs: one query row from here on
                q, x, T = q[:, :, -1:], x.view(B, T, -1)[:, -1], 1  # (B, H, 1, hd), (B, d)
                masks = [self._mask(input_pos, contiguous, kv_len, True, s) for s in (False, True)[: len(tables)]]
                mask = masks[sliding]
            y = F.scaled_dot_product_attention(q.reshape(B, n_kv, -1, hd), k, v, attn_mask=mask,
                                               scale=feats.scale)  # (B, n_kv, G*T, hd)  # fmt: skip
            # GQA by query grouping (see gqa_attention); one query row per head needs no transpose
            y = y.reshape(B, H * hd) if T == 1 else y.view(B, H, T, hd).transpose(1, 2).reshape(B * T, H * hd)
            if post is not None:  # Gemma: the attention's output normed before the add
                a = _packed_linear(y, o, None) if packed else torch.mm(y, o.t() if compiled else o)  # (B*T, d)
                x = x + _rms(a, d_eps) * post[0]
            else:
                x = _packed_linear_add(y, o, x) if packed else torch.addmm(x, y, o.t() if compiled else o)  # x + y o^T
            gate, up = linear(_rms(x, d_eps), gate_up, None).chunk(2, dim=-1)  # (B*T, ffn) each
            hidden = gate_activation(gate, feats.activation) * up  # (B*T, ffn)
            if post is not None:  # Gemma: the MLP's output normed before the add
                if packed:
                    m = _packed_linear(hidden, down, None)
                else:
                    m = torch.mv(down, hidden.view(-1)).view(1, -1) if B * T == 1 else torch.mm(hidden, down.t())
                x = x + _rms(m, d_eps) * post[1]
            elif packed:
                x = _packed_linear_add(hidden, down, x)  # (B*T, d)
            elif B * T == 1:  # one row: dot products over the (d, ffn) rows read faster than x @ W^T for d < ffn
                x = torch.addmv(x.view(-1), down, hidden.view(-1)).view(1, -1)  # (1, d)
            else:
                x = torch.addmm(x, hidden, down.t())  # (B*T, d)
        return linear(_rms(x, d_eps), plan.head, None).view(B, T, -1)  # (B, T, V)
