"""Tiny random models for runtime tests.

Weights are re-drawn with a large std and untied head so greedy outputs vary (std 0.02 makes a
2-layer model repeat its input); float64 where a test compares two computation orders exactly.
"""

from __future__ import annotations

import pytest
import torch

from distillgates.hardware import torch_threads
from distillgates.model import Transformer

from ..conftest import tiny_model_config


def random_model(
    seed: int, *, vocab_size: int = 48, d_model: int = 32, n_layers: int = 2, max_seq_len: int = 64,
    dtype: torch.dtype = torch.float32, std: float = 0.3,
) -> Transformer:  # fmt: skip
    torch.manual_seed(seed)
    cfg = tiny_model_config(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, ffn_hidden=2 * d_model,
                            max_seq_len=max_seq_len, tie_embeddings=False)  # fmt: skip
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
    with torch_threads(1):
        yield
