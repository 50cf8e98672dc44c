"""The fused decoder (``runtime.decoder.FusedDecoder``) against the model's own forward.

``Transformer.forward`` with ``input_pos`` is the reference: same parameters and cache buffers,
no fused weights.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distillgates.config import ModelConfig
from distillgates.model import Transformer
from distillgates.runtime.decoder import MATMULS, FusedDecoder, Matmuls, compiled_available, packed_available

from .conftest import tiny_model_config

CFG = tiny_model_config(max_seq_len=48)
CPU = torch.device("cpu")
CAN_PACK, CAN_COMPILE = packed_available(torch.float32, CPU), compiled_available(torch.float32, CPU)
AVAILABLE = [m for m in MATMULS if {"packed": CAN_PACK, "compiled": CAN_COMPILE}.get(m, True)]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (idx, input_pos) -> logits


def _model(seed: int = 0, cfg: ModelConfig = CFG) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so folding them into the matmuls is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _decoder(
    model: Transformer, batch: int = 1, fold_rotation: bool | None = None, matmuls: Matmuls | None = None
) -> FusedDecoder:
    model.setup_caches(batch)
    return FusedDecoder(model, fold_rotation, matmuls)


def _run(forward: Forward, idx: torch.Tensor, start: int) -> torch.Tensor:
    """Prefill ``idx[:, :start]`` then decode the rest one token at a time; logits ``(B, T, V)``."""
    with torch.inference_mode():
        out = [forward(idx[:, :start], torch.arange(start))]
        for pos in range(start, idx.shape[1]):
            out.append(forward(idx[:, pos : pos + 1], torch.tensor([pos])))
    return torch.cat(out, dim=1).clone()


@settings(max_examples=20, deadline=None)
@given(start=st.integers(1, 10), n=st.integers(1, 8), batch=st.integers(1, 2), seed=st.integers(0, 50),
       n_kv=st.sampled_from([1, 2, 4]), fold_rotation=st.booleans(),
       matmuls=st.sampled_from(AVAILABLE),
       family=st.sampled_from(["llama", "attention_bias", "qk_norm", "gemma3"]))  # fmt: skip
def test_decoder_matches_module_path(
    start: int, n: int, batch: int, seed: int, n_kv: int, fold_rotation: bool, matmuls: Matmuls, family: str
) -> None:
    gemma3 = {"qk_norm": True, "embed_scale": True, "activation": "gelu_tanh", "sandwich_norm": True,
              "query_pre_attn_scalar": 6, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"],
              "rope_local_theta": 100.0}  # a window shorter than most prompts  # fmt: skip
    extra = {"attention_bias": {"attention_bias": True}, "qk_norm": {"qk_norm": True}, "gemma3": gemma3}.get(family, {})
    cfg = ModelConfig(**{**CFG.__dict__, "n_kv_heads": n_kv, **extra})
    model = _model(seed, cfg)
    if family == "attention_bias":  # non-zero biases, so that folding them is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.uniform_(-0.5, 0.5)
    idx = torch.randint(0, cfg.vocab_size, (batch, start + n), generator=torch.Generator().manual_seed(seed))
    model.setup_caches(batch)
    ref = _run(model, idx, start)
    got = _run(_decoder(model, batch, fold_rotation, matmuls).forward, idx, start)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_rotation_is_folded_for_small_models_only() -> None:
    model = _model()
    assert _decoder(model).fold_rotation  # the tiny test model: dispatch-bound
    big = Transformer(ModelConfig(**{**CFG.__dict__, "vocab_size": 40_000, "d_model": 128})).eval()
    assert not _decoder(big).fold_rotation  # > DISPATCH_BOUND_MAX_BYTES: bound by weight reads


BIG = ModelConfig(**{**CFG.__dict__, "vocab_size": 40_000, "d_model": 128})  # > DISPATCH_BOUND_MAX_BYTES


@pytest.mark.skipif(not (CAN_PACK and CAN_COMPILE), reason="needs oneDNN packed linear and a C++ compiler")
def test_large_models_default_to_the_kernels_that_read_weights_fastest() -> None:
    """A model bound by weight reads decodes one row over compiled reductions and several rows over oneDNN's
    packed weights; a dispatch-bound model runs MKL. The logits stay the module's."""
    big, idx = _model(5, BIG), torch.randint(0, 40_000, (1, 5), generator=torch.Generator().manual_seed(5))
    batched, small = _decoder(big, batch=2), _decoder(_model())
    one_row = _decoder(big)  # the model's cache now has one row; `batched` keeps its own two-row buffers
    torch.testing.assert_close(_run(one_row.forward, idx, 2), _run(big, idx, 2), atol=1e-5, rtol=1e-4)
    assert (one_row.plan().matmuls, batched.plan().matmuls, small.plan().matmuls) == ("compiled", "packed", "mkl")
    assert one_row.plan().head.is_contiguous() and batched.plan().head.is_mkldnn  # packed: an opaque oneDNN tensor


@pytest.mark.skipif(not CAN_PACK, reason="this torch build has no oneDNN packed linear")
def test_without_a_compiler_one_row_packs_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C++ compiler for inductor: a one-row decoder of a large model runs oneDNN's packed weights while torch
    runs more than one thread and MKL on one (the plan is rebuilt when the thread count changes)."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not compiled_available(torch.float32, CPU)
    threads = torch.get_num_threads()
    big, idx = _model(5, BIG), torch.randint(0, 40_000, (1, 5), generator=torch.Generator().manual_seed(5))
    one_row = _decoder(big)
    try:
        for n, matmuls in ((1, "mkl"), (2, "packed"), (1, "mkl")):
            torch.set_num_threads(n)
            torch.testing.assert_close(_run(one_row.forward, idx, 2), _run(big, idx, 2), atol=1e-5, rtol=1e-4)
            assert one_row.plan().matmuls == matmuls
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("matmuls", ["packed", "compiled"])
def test_packed_and_compiled_need_float32_on_cpu(matmuls: Matmuls) -> None:
    model = _model().to(torch.bfloat16)
    model.setup_caches(1)
    with pytest.raises(ValueError, match=r"float32.*bfloat16"):
        FusedDecoder(model, matmuls=matmuls)


def test_in_place_weight_update_is_seen() -> None:
    """The fused weights are a cache: an optimizer-style in-place update must invalidate them."""
    model = _model()
    idx = torch.randint(0, CFG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    decoder = _decoder(model)
    before = _run(decoder.forward, idx, 3)
    with torch.no_grad():
        model.layers[1].attn.k_proj.weight.mul_(3.0)
        model.layers[0].mlp_norm.weight.add_(0.5)
    after = _run(decoder.forward, idx, 3)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, _run(model, idx, 3), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_drops_the_plan(assign: bool) -> None:
    model, other = _model(0), _model(1)
    idx = torch.randint(0, CFG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    decoder = _decoder(model)
    _run(decoder.forward, idx, 2)  # builds the plan from model's own weights
    model.load_state_dict(other.state_dict(), assign=assign)
    other.setup_caches(1)
    torch.testing.assert_close(_run(decoder.forward, idx, 2), _run(other, idx, 2), atol=1e-5, rtol=1e-4)


def test_fused_weights_are_plain_tensors_usable_under_no_grad() -> None:
    """Built inside ``inference_mode``, the plan must still work from ``torch.no_grad``."""
    model = _model()
    idx = torch.randint(0, CFG.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    decoder = _decoder(model)
    _run(decoder.forward, idx, 2)
    assert not decoder.plan().head.is_inference()
    with torch.no_grad():  # not inference mode
        logits = decoder.forward(idx[:, 3:4], torch.tensor([3]))
    assert logits.shape == (1, 1, CFG.vocab_size)


def test_decoder_needs_the_kv_cache() -> None:
    with pytest.raises(ValueError, match=r"setup_caches"):
        FusedDecoder(_model())


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("prompt", [1, 6, 20])
def test_last_only_gives_the_last_row_and_the_same_cache(n_layers: int, prompt: int) -> None:
    """``last_only`` skips the last layer's attention and MLP for every row but the last: the last row's
    logits and every K/V slot are those of the full forward (the next forward reads them)."""
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": n_layers})
    model = _model(4, cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, prompt + 3), generator=torch.Generator().manual_seed(4))
    runs = []
    for last_only in (False, True):
        decoder = _decoder(model, 2)
        with torch.inference_mode():
            prefill = decoder.forward(idx[:, :prompt], torch.arange(prompt), last_only=last_only)[:, -1]
            after = decoder.forward(idx[:, prompt:], torch.arange(prompt, prompt + 3))
        runs.append((prefill.clone(), after.clone()))
    torch.testing.assert_close(runs[1], runs[0], atol=1e-5, rtol=1e-4)
    model.setup_caches(2)
    with torch.inference_mode():  # the module path slices the same way
        module = model(idx[:, :prompt], torch.arange(prompt), last_only=True).clone()
    assert module.shape == (2, 1, cfg.vocab_size)
    torch.testing.assert_close(module[:, -1], runs[0][0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("last_only", [False, True])
@pytest.mark.parametrize("length", [4, 20])
def test_positions_out_of_order_match_module_path(last_only: bool, length: int) -> None:
    """Engines write contiguous positions (RoPE and mask rows as views); any other order takes the gather."""
    model = _model(5)
    idx = torch.randint(0, CFG.vocab_size, (1, length + 3), generator=torch.Generator().manual_seed(5))
    positions = torch.randperm(length, generator=torch.Generator().manual_seed(6))
    out = []
    for forward in (_decoder(model).forward, model):
        with torch.inference_mode():
            first = forward(idx[:, :length], positions, last_only=last_only)
            rest = forward(idx[:, length:], torch.arange(length, length + 3))
        out.append(torch.cat([first, rest], dim=1).clone())
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-4)
