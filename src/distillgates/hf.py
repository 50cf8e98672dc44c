"""Hugging Face interop: our :class:`~distillgates.model.Transformer` <-> ``*ForCausalLM``.

Families: Llama (SmolLM is one; Llama 3 RoPE scaling), Mistral, Qwen2/2.5 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm) and Gemma 3's text model (``gemma3_text``: scaled embeddings, GeGLU,
four norms a layer, ``query_pre_attn_scalar``, sliding-window layers with their own RoPE base), with
tied or untied embeddings. Weights move both ways by a rename table (module names already follow HF
Llama, and RoPE uses its ``rotate_half`` convention, so no permutation); configs map field by field.
Gemma's RMSNorm multiplies by ``1 + w``: its norm weights are stored here as ``1 + w`` (``fl(1 + w)``
is what HF computes, so the logits are the same; back in HF format ``(1 + w) - 1`` is exact in
floating point, and HF's ``1 + that`` gives the same factor again).

Conversion is strict, never a silent drop: an unknown ``model_type``, a setting we do not compute
(another RoPE type, a sliding window in effect, MLP or output-projection biases, an activation
other than SiLU) or a weight left unused or missing raises :class:`HFConversionError` naming it.
``max_seq_len`` (RoPE table, causal mask and KV cache length) is the caller's, clamped to the
largest enumerated shape, never the checkpoint's 32k-128k context. Everything is local, nothing
is downloaded; ``transformers`` is imported inside the functions that need it.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distillgates.config import ModelConfig, RopeScaling
from distillgates.io import staging_dir
from distillgates.model import Transformer


class HFConversionError(ValueError):
    """A Hugging Face checkpoint (or config) that we cannot convert exactly."""


@dataclass(frozen=True)
class _Family:
    config_class: str
    model_class: str
    qkv_bias: str  # "none", "always" (Qwen2), or "config" (the checkpoint's attention_bias, which also biases o_proj)
    qk_norm: bool


_FAMILIES = {
    "llama": _Family("LlamaConfig", "LlamaForCausalLM", "config", qk_norm=False),
    "mistral": _Family("MistralConfig", "MistralForCausalLM", "none", qk_norm=False),
    "qwen2": _Family("Qwen2Config", "Qwen2ForCausalLM", "always", qk_norm=False),
    "qwen3": _Family("Qwen3Config", "Qwen3ForCausalLM", "config", qk_norm=True),
    "gemma3_text": _Family("Gemma3TextConfig", "Gemma3ForCausalLM", "config", qk_norm=True),
}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_ROPE_TYPES = ("default", "linear", "llama3")


def _hf_name(name: str, gemma: bool = False) -> str:
    """Our parameter name -> the HF one (``layers.3.attn_norm.weight`` -> ``model.layers.3.input_layernorm.weight``;
    ``gemma``: Gemma 3's four norms a layer)."""
    if name == "lm_head.weight":
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    norms = _GEMMA_NORMS if gemma else _LLAMA_NORMS
    name = re.sub(r"\.(attn_norm|post_attn_norm|mlp_norm|post_mlp_norm)\.", lambda m: f".{norms[m[1]]}.", name)
    return "model." + re.sub(r"\.attn\.", ".self_attn.", name)


def _is_norm(name: str) -> bool:
    """Whether our parameter ``name`` is an RMSNorm weight (Gemma's are ``1 + w`` here, ``w`` in HF)."""
    return name.endswith("norm.weight")


def family_of(cfg: ModelConfig) -> str:
    """The HF ``model_type`` that :func:`to_hf` writes for ``cfg`` (Llama unless a feature needs another)."""
    if cfg.qk_norm and cfg.attention_bias:
        raise HFConversionError("no supported family has q/k norm and q/k/v biases without an o_proj bias")
    if gemma := cfg.gemma_features():
        missing = [name for name in ("embed_scale", "sandwich_norm", "qk_norm") if not getattr(cfg, name)]
        if missing or cfg.activation != "gelu_tanh" or cfg.attention_bias:
            raise HFConversionError(f"{', '.join(gemma)} are Gemma 3's, but gemma3_text also needs embed_scale, "
                                    f"sandwich_norm, qk_norm and activation gelu_tanh without attention_bias (missing: "
                                    f"{', '.join(missing) or 'activation or attention_bias'})")  # fmt: skip
        return "gemma3_text"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"


def hf_config(cfg: ModelConfig, model_type: str | None = None) -> Any:
    """The equivalent ``transformers`` config (``model_type`` default: :func:`family_of`)."""
    import transformers

    model_type = model_type or family_of(cfg)
    family = _family(model_type, "model_type")
    if cfg.qk_norm != family.qk_norm or cfg.attention_bias != (family.qkv_bias == "always"):
        raise HFConversionError(f"{model_type} cannot hold qk_norm={cfg.qk_norm}, attention_bias={cfg.attention_bias}")
    if cfg.residual_scale != 1.0:
        raise HFConversionError(f"residual_scale {cfg.residual_scale} (the export's fp16 scaling) has no HF field")
    if model_type != "gemma3_text" and family_of(cfg) == "gemma3_text":
        raise HFConversionError(f"{model_type} cannot hold Gemma 3's features (write it as gemma3_text)")
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
    extra: dict[str, Any] = {"hidden_act": "silu"}
    if model_type == "llama":
        extra |= {"attention_bias": False, "mlp_bias": False}
    elif model_type == "qwen3":
        extra |= {"attention_bias": False}
    if model_type in ("mistral", "qwen2", "qwen3"):
        extra["sliding_window"] = None
    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        extra = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                 "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
                 "layer_types": cfg.layer_types or ["full_attention"] * cfg.n_layers,
                 "sliding_window": cfg.sliding_window or cfg.max_seq_len, "final_logit_softcapping": None,
                 "attn_logit_softcapping": None, "use_bidirectional_attention": False}  # fmt: skip
        rope = {"full_attention": rope, "sliding_attention": local}
    return getattr(transformers, family.config_class)(
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
        **extra,
    )


def _family(model_type: str, where: str) -> _Family:
    if model_type not in _FAMILIES:
        raise HFConversionError(
            f"{where}: unsupported model_type {model_type!r} (supported: {', '.join(sorted(_FAMILIES))})"
        )
    return _FAMILIES[model_type]


def model_config_from_hf(hf_cfg: Any, max_seq_len: int | None = None) -> ModelConfig:
    """ModelConfig from a supported ``transformers`` config.

    Args:
        max_seq_len: the KV cache, mask and RoPE table length to build (the run's largest enumerated
            shape); None: the checkpoint's ``max_position_embeddings``.

    Raises:
        HFConversionError: naming the model_type or setting that we do not compute exactly.
    """
    model_type = getattr(hf_cfg, "model_type", None) or "<none>"
    family = _family(model_type, "config.json")
    where = f"{model_type} config"
    gemma = model_type == "gemma3_text"
    field, act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    if getattr(hf_cfg, field, act) != act:
        raise HFConversionError(f"{where}: {field} {getattr(hf_cfg, field)!r} is not supported ({act} only)")
    if getattr(hf_cfg, "mlp_bias", False):
        raise HFConversionError(f"{where}: mlp_bias=True is not supported")
    if family.qkv_bias == "config" and getattr(hf_cfg, "attention_bias", False):
        raise HFConversionError(f"{where}: attention_bias=True (a bias on o_proj too) is not supported")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf_cfg, name, None) is not None:
            raise HFConversionError(f"{where}: {name}={getattr(hf_cfg, name)} is not supported")
    if getattr(hf_cfg, "use_bidirectional_attention", False):
        raise HFConversionError(f"{where}: use_bidirectional_attention=True is not supported (a causal decoder only)")
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    local_theta = None
    if gemma:  # one RoPE per layer type: the global layers' (maybe scaled), the sliding layers' (plain)
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise HFConversionError(f"{where}: sliding_attention rope_type {local['rope_type']!r} is not supported")
        local_theta = float(local.get("rope_theta", 10000.0))
        rope = dict(rope.get("full_attention") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        supported = ", ".join(_ROPE_TYPES)
        raise HFConversionError(f"{where}: rope_type {rope_type!r} is not supported (supported: {supported})")
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    scaling = None
    if rope_type != "default":
        scaling = RopeScaling(
            kind=rope_type,
            factor=rope["factor"],
            low_freq_factor=rope.get("low_freq_factor", 1.0),
            high_freq_factor=rope.get("high_freq_factor", 4.0),
            original_max_seq_len=rope.get("original_max_position_embeddings", 8192),
        )
    hf_max = hf_cfg.max_position_embeddings
    if max_seq_len is not None and max_seq_len > hf_max:
        raise HFConversionError(f"{where}: max_position_embeddings {hf_max} is below the {max_seq_len} needed")
    seq_len = max_seq_len or hf_max
    window = _sliding_window(hf_cfg, model_type)
    if window is not None and window < seq_len and not gemma:
        raise HFConversionError(
            f"{where}: sliding_window {window} is in effect below max_seq_len {seq_len} (not supported)"
        )
    features: dict[str, Any] = {}
    if gemma:
        layer_types = list(hf_cfg.layer_types)
        sliding = "sliding_attention" in layer_types
        features = {"embed_scale": True, "activation": "gelu_tanh", "sandwich_norm": True,
                    "query_pre_attn_scalar": int(hf_cfg.query_pre_attn_scalar),
                    "layer_types": layer_types if sliding else None, "sliding_window": window if sliding else None,
                    "rope_local_theta": local_theta if sliding else None}  # fmt: skip
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size,
        d_model=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=hf_cfg.num_key_value_heads,
        ffn_hidden=hf_cfg.intermediate_size,
        max_seq_len=seq_len,
        head_dim=getattr(hf_cfg, "head_dim", None),
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        attention_bias=family.qkv_bias == "always",
        qk_norm=family.qk_norm,
        **features,
    )


def _sliding_window(hf_cfg: Any, model_type: str) -> int | None:
    """The attention window of any layer, or None when every layer attends the full context."""
    window = getattr(hf_cfg, "sliding_window", None)
    if window is None or model_type == "llama":
        return None
    layer_types = getattr(hf_cfg, "layer_types", None)
    if model_type != "mistral" and layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def hf_model_class(cfg: ModelConfig) -> Any:
    """The ``transformers`` ``*ForCausalLM`` class of the family ``cfg`` describes (:func:`family_of`)."""
    import transformers

    return getattr(transformers, _family(family_of(cfg), "model_type").model_class)


def to_hf(model: Transformer, model_type: str | None = None) -> Any:
    """Copy weights into a new HF ``*ForCausalLM`` (same logits); ``model_type`` default: :func:`family_of`."""
    import transformers

    model_type = model_type or family_of(model.config)
    model_class = getattr(transformers, _family(model_type, "model_type").model_class)
    # transformers types PreTrainedModel.to (@wraps(Module.to)) as taking the model as its first argument
    hf = model_class(hf_config(model.config, model_type)).to(model.embed.weight.dtype)
    gemma = model_type == "gemma3_text"
    state = {_hf_name(k, gemma): v - 1 if gemma and _is_norm(k) else v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:  # an internal invariant: our names and HF's must cover each other
        raise AssertionError(f"to_hf {model_type}: missing {missing}, unexpected {unexpected}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def from_hf(hf_model: Any, max_seq_len: int | None = None) -> Transformer:
    """Build a :class:`Transformer` from a supported HF ``*ForCausalLM`` (same logits).

    Raises:
        HFConversionError: see :func:`model_config_from_hf`; or a checkpoint weight that no
            parameter takes (unused), a parameter the checkpoint lacks (missing), or a shape mismatch.
    """
    cfg = model_config_from_hf(hf_model.config, max_seq_len)
    model = Transformer(cfg).to(hf_model.dtype)
    hf_state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    gemma = _model_type(hf_model) == "gemma3_text"
    wanted = {name: _hf_name(name, gemma) for name in model.state_dict()}
    if cfg.tie_embeddings:  # one tensor: HF lists lm_head.weight only when it is the embedding itself
        wanted["lm_head.weight"] = "model.embed_tokens.weight"
        head = hf_state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, hf_state.get("model.embed_tokens.weight", head)):
            raise HFConversionError(f"{_model_type(hf_model)}: tie_word_embeddings is set but lm_head.weight differs "
                                    "from model.embed_tokens.weight")  # fmt: skip
    missing = sorted(set(wanted.values()) - set(hf_state))
    unused = sorted(set(hf_state) - set(wanted.values()))
    if missing or unused:
        raise HFConversionError(
            f"{_model_type(hf_model)}: checkpoint weights do not match the model: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unused {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    state = {}
    for name, tensor in model.state_dict().items():
        source = hf_state[wanted[name]]
        if source.shape != tensor.shape:
            raise HFConversionError(f"{_model_type(hf_model)}: {wanted[name]} has shape {tuple(source.shape)}, "
                                    f"expected {tuple(tensor.shape)}")  # fmt: skip
        state[name] = 1 + source if gemma and _is_norm(name) else source  # Gemma's norm: 1 + w
    model.load_state_dict(state)
    return model.eval()


def _model_type(hf_model: Any) -> str:
    return str(getattr(hf_model.config, "model_type", type(hf_model).__name__))


def load_hf(path: str | Path, max_seq_len: int | None = None) -> Transformer:
    """A :class:`Transformer` (fp32) from a local HF checkpoint directory (nothing is downloaded).

    The model type is checked from ``config.json`` before any weight is read.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        HFConversionError: see :func:`from_hf`, naming ``path``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no Hugging Face checkpoint (config.json) in this directory")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        model_config_from_hf(hf_cfg, max_seq_len)  # fail before loading weights
        hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        return from_hf(hf, max_seq_len)
    except HFConversionError as err:
        raise HFConversionError(f"{path / 'config.json'}: {err}") from None


def save_hf(model: Transformer, out_dir: str | Path, tokenizer: Any = None, model_type: str | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) in Hugging Face format, whole or not at all.

    Written into a sibling temporary directory, then renamed over ``out_dir``, so a crash leaves
    either the previous directory or the new one, never a half-written mix.
    """
    out_dir = Path(out_dir)
    tmp = staging_dir(out_dir)
    try:
        to_hf(model, model_type).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


__all__ = ["HFConversionError", "family_of", "from_hf", "hf_config", "load_hf", "model_config_from_hf", "save_hf",
           "to_hf"]  # fmt: skip

