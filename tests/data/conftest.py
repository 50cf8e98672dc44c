"""Shared, session-scoped toy data for the data tests: a few hundred items and their tokenizer."""

from __future__ import annotations

import pytest

from distillgates.data.chat import render_conversation
from distillgates.data.generator import generate_items
from distillgates.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def toy_items():
    return generate_items(seed=0, n=400)


@pytest.fixture(scope="session")
def toy_tokenizer(toy_items):
    return train_tokenizer([render_conversation(item) for item in toy_items], vocab_size=768)
