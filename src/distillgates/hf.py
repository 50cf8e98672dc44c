"""Hugging Face interop: our :class:`~distillgates.model.Transformer` <-> ``LlamaForCausalLM``.

Weights move both ways by a rename table (module names already follow HF Llama, and RoPE uses
its ``rotate_half`` convention, so no permutation); configs map field by field. Everything is
built locally, nothing is downloaded. ``transformers`` is imported inside the functions that
need it.
"""

from __future__ import annotations

from typing import Any

from distillgates.config import ModelConfig, RopeScaling
from distillgates.model import Transformer

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
