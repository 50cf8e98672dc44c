"""Trainer test artefacts: toy items, a trained tokenizer, a KD set from a tiny teacher (all tiny).

The fixtures below serve the in-process tests; ``run_tiny.py`` (subprocess runs: kill/resume,
torchrun; run as the module ``tests.train.run_tiny``) imports the same helpers from this file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.config import Config, ModelConfig, ShapesConfig, TrainConfig, from_dict
from distillgates.data.chat import render_conversation, render_prompt
from distillgates.data.generator import generate_items
from distillgates.model import Transformer
from distillgates.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

from ..conftest import tiny_model_config

SHAPES = [96, 128, 192]


def build_artifacts(root: Path, n_train: int = 24, n_eval: int = 8) -> dict[str, Any]:
    """Items, tokenizer (saved under root/data/tokenizer) and an offline KD set (root/kd/kd.jsonl)."""
    train = generate_items(0, n_train, split="train")
    evals = generate_items(0, n_eval, split="eval")
    tok_dir = root / "data" / "tokenizer"
    if not tok_dir.exists():
        tok = train_tokenizer([render_conversation(i) for i in train + evals], vocab_size=400)
        save_tokenizer(tok, tok_dir)
    tok = load_tokenizer(tok_dir)
    kd_path = root / "kd" / "kd.jsonl"
    if not kd_path.exists():
        write_kd_set(kd_path, train, tok, k=8)
    return {"train": train, "eval": evals, "tokenizer": tok, "kd_path": kd_path}


def write_kd_set(path: Path, items: list[dict[str, Any]], tok: Any, k: int) -> None:
    """A KD set in the teacher's format (``distillgates.teacher.kd``) from a tiny random teacher,
    teacher-forced on each reference (completion = reference); no top-k at injected tool results."""
    from distillgates.data.fingerprints import prompt_wrapper_sha256, tokenizer_fingerprint, tool_registry_sha256
    from distillgates.teacher.kd import KD_VERSION

    torch.manual_seed(123)
    teacher = Transformer(model_config(len(tok), d_model=48)).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"__header__": True, "kd_version": KD_VERSION, "teacher_model_id": "test:tiny-random",
              "tokenizer_fingerprint": tokenizer_fingerprint(tok), "tool_registry_sha256": tool_registry_sha256(),
              "prompt_wrapper_sha256": prompt_wrapper_sha256(), "items_sha256": "test", "top_k": k,
              "total": len(items)}
    lines = [json.dumps(header)]
    result_id = tok.convert_tokens_to_ids("<|tool_result|>")
    end_id = tok.convert_tokens_to_ids("<|end|>")
    for item in items:
        prompt = tok.encode(render_prompt(item), add_special_tokens=False)
        completion = tok.encode(item["reference"], add_special_tokens=False)[: max(SHAPES) - len(prompt)]
        with torch.no_grad():
            logp = teacher(torch.tensor([prompt + completion])).log_softmax(-1)[0, len(prompt) - 1 : -1]  # (n, V)
        vals, top = logp.topk(k, -1)
        top_ids, top_lps, injected = [], [], False
        for i, tok_id in enumerate(completion):
            injected = injected or tok_id == result_id
            top_ids.append([] if injected else top[i].tolist())
            top_lps.append([] if injected else [round(v, 6) for v in vals[i].tolist()])
            if injected and tok_id == end_id:
                injected = False  # end of the tool result (the trainer applies KD only inside assistant turns)
        lines.append(json.dumps({
            "id": item["id"], "prompt_text": render_prompt(item), "completion_text": tok.decode(completion),
            "completion_ids": completion, "topk_ids": top_ids, "topk_logprobs": top_lps, "request_id": "r",
            "request_ids": ["r"], "calls": item["expected_calls"], "answer": None, "fixture_hits": [], "finish": "stop",
        }))
    path.write_text("\n".join(lines) + "\n")


def model_config(vocab: int, d_model: int = 32) -> ModelConfig:
    return tiny_model_config(vocab_size=vocab, d_model=d_model, ffn_hidden=2 * d_model, max_seq_len=max(SHAPES))


def tiny_config(vocab: int, **train: Any) -> Config:
    fields: dict[str, Any] = {
        "steps": 8, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "ce_weight": 0.5, "process_weight": 0.5,
        "kd": {"kind": "forward", "temperature": 2.0, "weight": 1.0}, "length": {"weight": 0.2, "hinge": 0.15},
        "early_tool": {"weight": 0.3, "ramp_epochs": 1.0, "first_n_tokens": 8},
        "qat": {"enabled": False}, "ckpt_every": 0, "eval_every": 0, "log_every": 1,
    }
    fields.update(train)
    return Config(
        student=model_config(vocab), shapes=ShapesConfig(lengths=SHAPES, mix=[0.4, 0.4, 0.2]),
        train=from_dict(TrainConfig, fields),
    )


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("train_artifacts")
    art = build_artifacts(root)
    art["root"] = root
    art["make_config"] = tiny_config
    return art

