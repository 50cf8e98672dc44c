"""Hugging Face interop per family: logits parity (padding, KV-cached decode, fused decoder), strict conversion
errors, export back (``to_hf``/``save_hf``). Random tiny weights from the transformers config classes; nothing
is downloaded."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor

from distillgates.export.layout import ANETransformer, StandardLayout
from distillgates.hf import HFConversionError, from_hf, load_hf, save_hf, to_hf
from distillgates.model import Transformer, apply_rope
from distillgates.runtime.decoder import FusedDecoder, compiled_available, packed_available
from distillgates.tokenizer import train_tokenizer

from .conftest import assert_close, tiny_model_config

VOCAB, MAX_SEQ = 96, 48
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
FAMILIES: dict[str, Any] = {
    "llama3": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "smollm": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),  # SmolLM is a tied Llama
    "mistral": lambda: transformers.MistralConfig(**COMMON, tie_word_embeddings=False),  # window 4096: no effect
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),  # q/k norm, hd*H != d
}


def hf_model(config: Any, seed: int = 0) -> Any:
    """A random HF model; every weight (norms and biases too) moved off its init value so that each counts."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(params=sorted(FAMILIES))
def pair(request: pytest.FixtureRequest) -> tuple[Any, Transformer]:
    hf = hf_model(FAMILIES[request.param]())
    return hf, from_hf(hf, max_seq_len=MAX_SEQ)


def padded_batch(T: int = 14, pads: tuple[int, ...] = (0, 5, 2)) -> tuple[Tensor, Tensor]:
    """Left-padded ids ``(B, T)`` and attention mask (1 = real token)."""
    ids = torch.randint(0, VOCAB, (len(pads), T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(len(pads), T, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def test_conversion_keeps_the_families_features(pair: tuple[Any, Transformer]) -> None:
    hf, model = pair
    cfg = model.config
    assert cfg.max_seq_len == MAX_SEQ and model.causal_mask.shape == (MAX_SEQ, MAX_SEQ)  # clamped, not 4096
    assert cfg.attention_bias == (hf.config.model_type == "qwen2")
    assert cfg.qk_norm == (hf.config.model_type == "qwen3")
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) == cfg.n_params


@torch.no_grad()
def test_padded_forward_matches_hf(pair: tuple[Any, Transformer]) -> None:
    padded_forward_against_hf(*pair, atol=2e-5)


def padded_forward_against_hf(hf: Any, model: Transformer, atol: float) -> None:
    ids, mask = padded_batch()
    real = mask.bool()
    assert_close(model(ids, attention_mask=real)[real], hf(ids, attention_mask=mask).logits[real], atol=atol)


ENGINES = ["model", "fused", "fused-packed", "fused-compiled"]


@pytest.mark.parametrize("engine", ENGINES)
@torch.no_grad()
def test_cached_decode_matches_hf(pair: tuple[Any, Transformer], engine: str) -> None:
    """A left-padded prefill, then four KV-cached decode steps, against HF's own cache. The model takes the
    padding as an attention mask over cache slots; the fused decoder (the engine's batches) writes each row at
    its own positions, its padding at the slot its first decode step overwrites (``TorchEngine.write_rows``); with
    ``packed``, over oneDNN's packed weights (the default for large models' batches); ``compiled``, one row whose
    decode steps run the compiled reductions (the default for large models' batch-1 decode)."""
    cached_decode_against_hf(*pair, engine, atol=2e-5)


def cached_decode_against_hf(hf: Any, model: Transformer, engine: str, atol: float) -> None:
    if engine == "fused-packed" and not packed_available(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no oneDNN packed linear")
    if engine == "fused-compiled" and not compiled_available(torch.float32, torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    ids, mask = padded_batch(pads=(0,)) if engine == "fused-compiled" else padded_batch()
    B, T = ids.shape
    model.setup_caches(B)
    lengths = mask.sum(1).tolist()
    slots = torch.zeros(B, MAX_SEQ, dtype=torch.bool)  # the model's attention mask over cache slots
    slots[:, :T] = mask.bool()
    fused = FusedDecoder(model, matmuls={"fused-packed": "packed", "fused-compiled": "compiled"}.get(engine, "mkl"))

    def step(idx: Tensor, k: int) -> Tensor:
        """The prefill (``k`` -1), else decode step ``k``."""
        if engine != "model":  # per-row positions (B, T)
            rows = [[n] * (T - n) + list(range(n)) for n in lengths] if k < 0 else [[n + k] for n in lengths]
            return fused.forward(idx, torch.tensor(rows))
        if k >= 0:
            slots[:, T + k] = True
        return model(idx, torch.arange(T) if k < 0 else torch.tensor([T + k]), slots)

    ours = step(ids, -1)
    out = hf(ids, attention_mask=mask, use_cache=True)
    real = mask.bool()
    assert_close(ours[real], out.logits[real], atol=atol)
    past, hf_mask, token = out.past_key_values, mask, out.logits[:, -1].argmax(-1, keepdim=True)
    for k in range(4):
        hf_mask = torch.cat([hf_mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        ours = step(token, k)
        out = hf(token, attention_mask=hf_mask, past_key_values=past, use_cache=True)
        assert_close(ours[:, -1], out.logits[:, -1], atol=atol)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def test_to_hf_gives_back_the_family_and_the_logits(pair: tuple[Any, Transformer]) -> None:
    hf, model = pair
    back = to_hf(model, hf.config.model_type)
    assert type(back) is type(hf)
    ids, mask = padded_batch()
    real = mask.bool()
    assert_close(back(ids, attention_mask=mask).logits[real], hf(ids, attention_mask=mask).logits[real], atol=1e-5)


@torch.no_grad()
def test_standard_export_layout_computes_the_features(pair: tuple[Any, Transformer]) -> None:
    """The export's layout reuses the attention projection, so biases and q/k norms reach Core ML too."""
    _, model = pair
    layout, ids = StandardLayout(model), torch.randint(0, VOCAB, (1, 9))
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    x = layout.embed_tokens(ids)
    for i in range(model.config.n_layers):
        q, k, v = layout.qkv(i, x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = model.config.n_heads // model.config.n_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        x = layout.finish_block(i, x, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert_close(layout.head(x[:, -1:]), model(ids)[:, -1], atol=2e-5)


def test_ane_layout_refuses_features_it_lacks() -> None:
    model = from_hf(hf_model(FAMILIES["qwen3"]()), max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match="does not support qk_norm"):
        ANETransformer.from_standard(model)


def test_save_hf_round_trips_with_the_tokenizer(tmp_path: Path) -> None:
    tiny_tokenizer = train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300, min_frequency=1)
    # a Llama (the toy's family): AutoTokenizer maps a qwen2 config.json to Qwen2Tokenizer, which adds its own
    # <|endoftext|> to a foreign vocabulary
    model = from_hf(hf_model(FAMILIES["llama3"]()), max_seq_len=MAX_SEQ)
    out = save_hf(model, tmp_path / "hf", tiny_tokenizer)
    assert not [p for p in tmp_path.iterdir() if p.name != "hf"]  # the temporary directory is gone
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert reloaded.config.model_type == "llama" and reloaded.config.rope_parameters["rope_type"] == "llama3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert_close(reloaded(ids).logits, model(ids), atol=1e-5)
        assert_close(load_hf(out, MAX_SEQ)(ids), model(ids), atol=1e-5)


# ------------------------------------------------------------------ strict conversion: one test per failure


def _config(family: str, **overrides: Any) -> Any:
    config = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4),
         "unsupported model_type 'gpt2' (supported: gemma3_text, llama, mistral, qwen2, qwen3)"),
        (lambda: transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                     "factor": 4.0}),
         "rope_type 'yarn' is not supported"),
        (lambda: transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                     "factor": 2.0}),
         "rope_type 'dynamic' is not supported"),
        (lambda: transformers.MistralConfig(**{**COMMON, "max_position_embeddings": 64}, sliding_window=16),
         "sliding_window 16 is in effect below max_seq_len 48"),
        (lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=32, max_window_layers=0),
         "sliding_window 32 is in effect below max_seq_len 48"),
        (lambda: transformers.LlamaConfig(**COMMON, attention_bias=True), "attention_bias=True (a bias on o_proj"),
        (lambda: transformers.LlamaConfig(**COMMON, mlp_bias=True), "mlp_bias=True is not supported"),
        (lambda: transformers.LlamaConfig(**COMMON, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (lambda: transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 32}),
         "max_position_embeddings 32 is below the 48 needed"),
    ],
    ids=["unknown-model-type", "rope-yarn", "rope-dynamic", "mistral-window", "qwen2-window", "llama-attention-bias",
         "mlp-bias", "activation", "short-context"],
)
def test_unsupported_settings_are_errors_naming_them(make: Any, fragment: str) -> None:
    with pytest.raises(HFConversionError) as err:
        from_hf(transformers.AutoModelForCausalLM.from_config(make()), max_seq_len=MAX_SEQ)
    assert fragment in str(err.value)


def test_sliding_window_wider_than_the_context_is_accepted() -> None:
    model = from_hf(hf_model(transformers.MistralConfig(**COMMON, sliding_window=MAX_SEQ)), max_seq_len=MAX_SEQ)
    assert model.config.max_seq_len == MAX_SEQ


def test_unused_weight_is_an_error_naming_it() -> None:
    hf = hf_model(FAMILIES["smollm"]())
    hf.model.layers[1].self_attn.register_parameter("extra", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(HFConversionError, match=r"unused \['model\.layers\.1\.self_attn\.extra'\]"):
        from_hf(hf, max_seq_len=MAX_SEQ)


def test_missing_weight_is_an_error_naming_it() -> None:
    hf = hf_model(FAMILIES["qwen2"]())
    hf.model.layers[0].self_attn.k_proj.bias = None  # a Qwen2 checkpoint without one of its biases
    with pytest.raises(HFConversionError, match=r"missing \['model\.layers\.0\.self_attn\.k_proj\.bias'\]"):
        from_hf(hf, max_seq_len=MAX_SEQ)


def test_load_hf_names_the_file_and_reads_no_weight_of_an_unknown_type(tmp_path: Path) -> None:
    transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4).save_pretrained(tmp_path)
    with pytest.raises(HFConversionError, match=rf"{tmp_path / 'config.json'}: .*model_type 'gpt2'"):
        load_hf(tmp_path, MAX_SEQ)  # config only: it fails before looking for weights
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint"):
        load_hf(tmp_path / "absent", MAX_SEQ)


def test_a_gguf_file_is_hashed_once_per_process_until_it_changes(tmp_path, monkeypatch):
    """The run asks for the teacher's checkpoint directory several times: a GGUF file (93 MB at 135M) is hashed
    once while its size and modification time stay, again when it changes (then it is another conversion)."""
    import os

    from distillgates import checkpoints
    from distillgates.config import sha256_json
    from distillgates.io import sha256_file

    monkeypatch.setenv("DISTILLGATES_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    hashed: list[str] = []
    monkeypatch.setattr(checkpoints, "sha256_file", lambda path: hashed.append(path) or sha256_file(path))

    def converted() -> Path:  # the cache entry a conversion of the file as it is now would have made
        key = sha256_json({"file": sha256_file(file), "transformers": transformers.__version__})[:16]
        out = tmp_path / "cache" / "gguf" / f"model-{key}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        return out

    file.write_bytes(b"one")
    first = converted()
    assert checkpoints.gguf_checkpoint(file) == checkpoints.gguf_checkpoint(file) == first
    assert len(hashed) == 1
    file.write_bytes(b"two!")
    os.utime(file, ns=(1, 1))
    second = converted()
    assert checkpoints.gguf_checkpoint(file) == second != first and len(hashed) == 2


# ------------------------------------------------------------------ Gemma 3 (gemma3_text)

GEMMA_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=True)  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"


def _gemma(layer_types: list[str], window: int, scalar: int, full_rope: dict[str, Any] | None = None) -> Any:
    rope = {FULL: full_rope or {"rope_type": "default", "rope_theta": 1e6},
            SLIDING: {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    return transformers.Gemma3TextConfig(**GEMMA_COMMON, num_hidden_layers=len(layer_types), layer_types=layer_types,
                                         sliding_window=window, query_pre_attn_scalar=scalar, rope_parameters=rope)


GEMMA: dict[str, Any] = {  # windows shorter than the 14-token prompt; attention scale != head_dim ** -0.5
    "sliding-full-sliding": lambda: _gemma([SLIDING, FULL, SLIDING], window=5, scalar=24),
    "linear-rope-full-last": lambda: _gemma([SLIDING, SLIDING, FULL], window=3, scalar=32,
                                              full_rope={"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}),
    "all-full": lambda: _gemma([FULL, FULL], window=4, scalar=16),  # the window is set, no layer uses it
}


@pytest.fixture(params=sorted(GEMMA))
def gemma_pair(request: pytest.FixtureRequest) -> tuple[Any, Transformer]:
    hf = hf_model(GEMMA[request.param]())
    return hf, from_hf(hf, max_seq_len=MAX_SEQ)


def test_gemma3_conversion_keeps_its_features(gemma_pair: tuple[Any, Transformer]) -> None:
    hf, model = gemma_pair
    cfg, hf_cfg = model.config, hf.config
    sliding = SLIDING in hf_cfg.layer_types
    assert (cfg.embed_scale, cfg.activation, cfg.sandwich_norm, cfg.qk_norm) == (True, "gelu_tanh", True, True)
    assert cfg.query_pre_attn_scalar == hf_cfg.query_pre_attn_scalar and cfg.rope_theta == 1e6
    assert cfg.layer_types == (hf_cfg.layer_types if sliding else None)
    assert (cfg.sliding_window, cfg.rope_local_theta) == ((hf_cfg.sliding_window, 1e4) if sliding else (None, None))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) == cfg.n_params


@torch.no_grad()
def test_gemma3_padded_forward_matches_hf(gemma_pair: tuple[Any, Transformer]) -> None:
    padded_forward_against_hf(*gemma_pair, atol=1e-4)


@torch.no_grad()
def test_gemma3_cached_decode_matches_hf(gemma_pair: tuple[Any, Transformer]) -> None:
    """Prefill 14 tokens, then 6 cached decode steps past every window, against HF's own (sliding) cache."""
    hf, model = gemma_pair
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    model.setup_caches(2)
    T = ids.shape[1]
    ours, out = model(ids, torch.arange(T)), hf(ids, use_cache=True)
    assert_close(ours, out.logits, atol=1e-4)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for k in range(6):
        ours, out = model(token, torch.tensor([T + k])), hf(token, past_key_values=past, use_cache=True)
        assert_close(ours[:, -1], out.logits[:, -1], atol=1e-4)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def test_gemma3_goes_back_to_hf_with_the_same_logits(gemma_pair: tuple[Any, Transformer], tmp_path: Path) -> None:
    hf, model = gemma_pair
    back = to_hf(model)  # family_of: gemma3_text
    assert type(back) is type(hf) and back.config.layer_types == hf.config.layer_types
    ids, mask = padded_batch()
    real = mask.bool()
    assert_close(back(ids, attention_mask=mask).logits[real], hf(ids, attention_mask=mask).logits[real], atol=1e-5)
    reloaded = load_hf(save_hf(model, tmp_path / "hf"), MAX_SEQ)
    assert_close(reloaded(ids, attention_mask=real), model(ids, attention_mask=real), atol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
@torch.no_grad()
def test_gemma3_cached_decode_matches_hf_on_every_engine(gemma_pair: tuple[Any, Transformer], engine: str) -> None:
    """As :func:`test_cached_decode_matches_hf`, with windows shorter than the prompt: the fused decoder's sliding
    layers (their own RoPE rows and window masks; the compiled step narrows the cache to the window instead)."""
    cached_decode_against_hf(*gemma_pair, engine, atol=1e-4)


def test_the_ane_layout_refuses_gemma3_naming_its_features() -> None:
    model = from_hf(hf_model(GEMMA["sliding-full-sliding"]()), max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match="embed_scale, activation, sandwich_norm, query_pre_attn_scalar"):
        ANETransformer.from_standard(model)


@pytest.mark.parametrize(("override", "fragment"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e6},
                          SLIDING: {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     "sliding_attention rope_type 'linear' is not supported"),
])  # fmt: skip
def test_unsupported_gemma3_settings_are_errors_naming_them(override: dict[str, Any], fragment: str) -> None:
    config = GEMMA["sliding-full-sliding"]()
    for key, value in override.items():
        setattr(config, key, value)
    with pytest.raises(HFConversionError, match=fragment):
        from_hf(transformers.AutoModelForCausalLM.from_config(config), max_seq_len=MAX_SEQ)


@pytest.mark.parametrize(("overrides", "model_type", "fragment"), [
    ({"qk_norm": True, "attention_bias": True}, None, "no supported family has q/k norm and q/k/v biases"),
    ({"embed_scale": True}, None, "embed_scale are Gemma 3's, but gemma3_text also needs"),
    ({"qk_norm": True}, "llama", "llama cannot hold qk_norm=True, attention_bias=False"),
    ({"residual_scale": 0.5}, None, "residual_scale 0.5 (the export's fp16 scaling) has no HF field"),
    ({"embed_scale": True, "sandwich_norm": True, "qk_norm": True, "activation": "gelu_tanh"}, "qwen3",
     "qwen3 cannot hold Gemma 3's features"),
])  # fmt: skip
def test_a_model_no_hf_family_can_hold_is_refused(overrides: dict[str, Any], model_type: str | None,
                                                  fragment: str) -> None:
    from distillgates.hf import hf_config

    cfg = dataclasses.replace(tiny_model_config(), **overrides)
    with pytest.raises(HFConversionError, match=re.escape(fragment)):
        hf_config(cfg, model_type)
