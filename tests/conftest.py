"""Shared test helpers: deterministic seeds, tiny model configs, assert_close."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distillgates.config import ModelConfig


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def tiny_model_config(**overrides: object) -> ModelConfig:
    """A model small enough for unit tests (~30k params)."""
    fields: dict[str, object] = dict(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny_model_config()


@pytest.fixture
def make_tiny_cfg():
    """Factory fixture: ``make_tiny_cfg(n_layers=3, ...)``."""
    return tiny_model_config


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    __tracebackhide__ = True
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
