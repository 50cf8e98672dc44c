"""Shared test helpers: deterministic seeds, the torch thread count restored, tiny model configs, assert_close."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from distillgates.config import ModelConfig
from distillgates.hardware import torch_threads


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


# A test may set torch's intra-op thread count (tiny models run faster on one), and so may a module's
# fixtures (a pipeline run sets its config's count for the process): what comes next gets the count
# it would have had alone. Interop threads can be set only once per process; nothing here sets them.
@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    with torch_threads(torch.get_num_threads()):
        yield


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads_after_module() -> Iterator[None]:
    with torch_threads(torch.get_num_threads()):
        yield


def tiny_model_config(**overrides: object) -> ModelConfig:
    """The tests' one tiny model (~30k params); ``overrides`` only where a test needs a specific value
    (the vocabulary of a trained tokenizer, a longer cache, more layers)."""
    fields: dict[str, object] = dict(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    __tracebackhide__ = True
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
