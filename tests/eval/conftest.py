"""Eval test fixtures: a small generated eval set, a tiny tokenizer and a tiny random student."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.data.chat import render_conversation
from distillgates.data.dataset import write_dataset
from distillgates.data.generator import generate_items
from distillgates.model import Transformer, save_model
from distillgates.tokenizer import save_tokenizer, tokenizer_fingerprint, train_tokenizer

from ..conftest import tiny_model_config


@pytest.fixture(scope="session")
def eval_items() -> list[dict[str, Any]]:
    return generate_items(0, 60, split="eval")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, eval_items: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokenizer dir, eval dataset file and a tiny random student checkpoint (built once)."""
    root: Path = tmp_path_factory.mktemp("tiny_run")
    tok = train_tokenizer((render_conversation(i) for i in generate_items(0, 120)), vocab_size=400)
    save_tokenizer(tok, root / "tokenizer")
    items = eval_items[:12]
    write_dataset(root / "eval.jsonl", items, tokenizer_fingerprint(tok), seed=0)
    torch.manual_seed(0)
    # one layer, two heads: test_constrained_runner_emits_only_valid_calls steers these weights by hand
    cfg = tiny_model_config(vocab_size=len(tok), n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=384)
    save_model(root / "model.pt", Transformer(cfg))
    return {"root": root, "tokenizer": tok, "items": items, "model": root / "model.pt"}
