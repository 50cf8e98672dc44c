"""Tiny random models for runtime tests.

Weights are re-drawn with a large std and untied head so greedy outputs vary (std 0.02 makes a
2-layer model repeat its input); float64 where a test compares two computation orders exactly.
"""

from __future__ import annotations

import pytest
import torch

from distillgates.config import ModelConfig
from distillgates.model import Transformer


def random_model(
    seed: int, *, vocab_size: int = 48, d_model: int = 32, n_layers: int = 2, max_seq_len: int = 64,
    dtype: torch.dtype = torch.float32, std: float = 0.3,
) -> Transformer:  # fmt: skip
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden=2 * d_model,
        max_seq_len=max_seq_len, tie_embeddings=False,
    )  # fmt: skip
    model = Transformer(cfg).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="session")
def make_model():
    """A pure factory (no state), safe to share across tests and hypothesis examples."""
    return random_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are overhead-bound: extra intra-op threads on a shared 2-core box only add
    contention (measured ~20x slower decode with the default thread count under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
