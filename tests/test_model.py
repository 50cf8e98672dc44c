"""Student model: KV cache, masks, checkpointing, checkpoints and Hugging Face interop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distillgates.config import ModelConfig, RopeScaling
from distillgates.hf import from_hf, to_hf
from distillgates.io import ChecksumError
from distillgates.model import RMSNorm, Transformer, load_model, model_fingerprint, save_model

from .conftest import tiny_model_config

CFG = tiny_model_config(max_seq_len=48)


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


MODEL = _model()


@settings(max_examples=25, deadline=None)
@given(prompt_len=st.integers(1, 20), n_decode=st.integers(1, 12), batch=st.integers(1, 3), seed=st.integers(0, 99))
def test_kv_cache_decode_equals_full_forward(prompt_len: int, n_decode: int, batch: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (batch, prompt_len + n_decode), generator=gen)
    with torch.no_grad():
        full = MODEL(idx)  # (B, T, V)
        MODEL.setup_caches(batch)
        steps = [MODEL(idx[:, :prompt_len], torch.arange(prompt_len))]
        for pos in range(prompt_len, prompt_len + n_decode):
            steps.append(MODEL(idx[:, pos : pos + 1], torch.tensor([pos])))
        MODEL.remove_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=2, max_size=4), left=st.booleans(), seed=st.integers(0, 99))
def test_padding_does_not_change_logits_of_real_tokens(lengths: list[int], left: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    idx = torch.zeros(len(lengths), width, dtype=torch.long)
    valid = torch.zeros(len(lengths), width, dtype=torch.bool)
    seqs = [torch.randint(1, CFG.vocab_size, (n,), generator=gen) for n in lengths]
    for row, seq in enumerate(seqs):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        idx[row, span], valid[row, span] = seq, True
    with torch.no_grad():
        padded = MODEL(idx, attention_mask=valid)
        for row, seq in enumerate(seqs):
            alone = MODEL(seq[None])[0]  # (n, V)
            # left padding shifts absolute positions; RoPE scores depend only on relative ones
            torch.testing.assert_close(padded[row][valid[row]], alone, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(padded).all()


def test_left_padded_batch_in_cache_matches_unpadded_sequences() -> None:
    """With the cache, a left-padded row attends only its real slots (positions are slots)."""
    seq_a, seq_b = torch.randint(1, 96, (7,)), torch.randint(1, 96, (4,))
    idx = torch.zeros(2, 7, dtype=torch.long)
    idx[0], idx[1, 3:] = seq_a, seq_b
    slots = torch.zeros(2, CFG.max_seq_len, dtype=torch.bool)
    slots[0, :7], slots[1, 3:7] = True, True
    with torch.no_grad():
        MODEL.setup_caches(2)
        logits = MODEL(idx, torch.arange(7), attention_mask=slots)
        MODEL.remove_caches()
        # rope is relative: shifting all positions of seq_b by 3 leaves attention scores unchanged
        torch.testing.assert_close(logits[1, 3:], MODEL(seq_b[None])[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[0], MODEL(seq_a[None])[0], atol=1e-5, rtol=1e-5)


def test_padded_key_is_never_attended() -> None:
    """Changing the token under a padded slot must not change any real logit."""
    idx = torch.randint(1, 96, (1, 10))
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, 4] = False
    other = idx.clone()
    other[0, 4] = (idx[0, 4] + 1) % 96
    with torch.no_grad():
        a, b = MODEL(idx, attention_mask=valid), MODEL(other, attention_mask=valid)
    keep = valid[0].clone()
    keep[4] = False
    torch.testing.assert_close(a[0, keep], b[0, keep])
    assert not torch.allclose(a, MODEL(other))  # without the mask it does change


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 99), length=st.integers(2, 24))
def test_checkpointed_and_plain_gradients_match(seed: int, length: int) -> None:
    idx = torch.randint(0, 96, (2, length), generator=torch.Generator().manual_seed(seed))
    grads = []
    for checkpointing in (False, True):
        cfg = ModelConfig(**{**CFG.__dict__, "gradient_checkpointing": checkpointing})
        model = _model(cfg, seed=1).train()
        model(idx).logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_really_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    import distillgates.model as model_module

    calls = []
    real = model_module.checkpoint
    monkeypatch.setattr(model_module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(ModelConfig(**{**CFG.__dict__, "gradient_checkpointing": True})).train()
    model(torch.randint(0, 96, (1, 8))).sum().backward()
    assert len(calls) == CFG.n_layers
    calls.clear()
    with torch.no_grad():
        model(torch.randint(0, 96, (1, 8)))
    assert not calls  # no recompute bookkeeping at inference


def test_rmsnorm_matches_reference() -> None:
    x = torch.randn(3, 5, 32)
    norm = RMSNorm(32, 1e-6)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected)


def test_tied_and_untied_heads() -> None:
    tied = _model()
    assert tied.lm_head.weight is tied.embed.weight
    untied = _model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) == untied.config.n_params


def test_checkpoint_rebuilds_the_exact_model(tmp_path: Path) -> None:
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": 3, "rope_theta": 5e5, "tie_embeddings": False})
    model = _model(cfg, seed=3)
    save_model(tmp_path / "m.pt", model, step=7)
    loaded = load_model(tmp_path / "m.pt")
    assert loaded.config == cfg
    assert model_fingerprint(loaded) == model_fingerprint(model)
    idx = torch.randint(0, 96, (1, 9))
    torch.testing.assert_close(loaded.eval()(idx), model(idx))


def test_corrupted_checkpoint_is_refused(tmp_path: Path) -> None:
    save_model(tmp_path / "m.pt", MODEL)
    data = bytearray((tmp_path / "m.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "m.pt").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"m\.pt: checksum mismatch"):
        load_model(tmp_path / "m.pt")


@pytest.mark.parametrize(
    "scaling",
    [None, RopeScaling(kind="linear", factor=2.0), RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=16)],
    ids=["plain", "linear", "llama3"],
)
@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_interop_logits_parity_both_ways(scaling: RopeScaling | None, tied: bool) -> None:
    cfg = ModelConfig(**{**CFG.__dict__, "rope_scaling": scaling, "tie_embeddings": tied})
    model = _model(cfg, seed=5)
    idx = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        ours = model(idx)
        hf = to_hf(model)
        assert (hf(idx).logits - ours).abs().max() < 1e-4
        back = from_hf(hf)
        assert back.config == cfg
        assert (back(idx) - ours).abs().max() < 1e-4
