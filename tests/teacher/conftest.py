"""Tiny artifacts for teacher tests: a few toy items, a small tokenizer, a tiny random HF teacher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.config import APIConfig, Config, KDConfig, TeacherConfig
from distillgates.data.chat import render_conversation, template_chat_format
from distillgates.data.generator import generate_items
from distillgates.hf import hf_config
from distillgates.teacher.base import TurnResult
from distillgates.tokenizer import END, train_tokenizer

from ..conftest import tiny_model_config


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """Two cores shared by many processes: a second intra-op thread makes tiny models 10-100x slower
    (the root conftest's ``_restore_torch_threads`` restores the count after the test)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def toy_items() -> list[dict[str, Any]]:
    """Seven items covering every kind (two single, two multi)."""
    items = generate_items(seed=0, n=40, split="train")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        by_kind.setdefault(item["kind"], []).append(item)
    picked = [by_kind[kind][0] for kind in sorted(by_kind)] + [by_kind["single"][1], by_kind["multi"][1]]
    assert {"single", "multi", "control", "decline", "pii"} == {it["kind"] for it in picked}
    return picked


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    corpus = [render_conversation(it) for it in generate_items(seed=0, n=60, split="train")]
    return train_tokenizer(corpus, vocab_size=400, min_frequency=2)


@pytest.fixture(scope="session")
def chatml_tokenizer() -> Any:
    """A student tokenizer with the library's ChatML template (Hermes ``<tool_call>`` blocks), trained on
    the toy conversations rendered in ChatML (what ``tokenizer.chat_template: chatml`` builds)."""
    chatml = template_chat_format("chatml")
    corpus = [chatml.conversation(it) for it in generate_items(seed=0, n=60, split="train")]
    return train_tokenizer(corpus, vocab_size=500, min_frequency=2, chat_template="chatml")


def save_tiny_teacher(path: Path, tokenizer: Any, seed: int = 0) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    # one layer, two heads: test_local_teacher_kd_set's top-k rows fail with the tiny default's weights
    cfg = tiny_model_config(vocab_size=len(tokenizer), n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=1024)
    model = LlamaForCausalLM(hf_config(cfg)).eval()
    with torch.no_grad():  # larger weights than HF's init so greedy output varies (and is not all one token)
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_teacher(tiny_teacher_dir: Path) -> Any:
    from distillgates.teacher.local import LocalTeacher

    return LocalTeacher(tiny_teacher_dir)


def kd_config(kind: str = "local", api: dict[str, Any] | None = None, **kd: Any) -> Config:
    """A config for the KD builder: a tiny ``kd`` section (``kd`` overrides it) and the teacher's kind and API."""
    fields: dict[str, Any] = dict(top_k=4, max_new_tokens=6, max_turns=3, batch_size=2, ckpt_every=2) | kd
    return Config(teacher=TeacherConfig(kind=kind, api=APIConfig(**(api or {}))), kd=KDConfig(**fields))


class ReplayTeacher:
    """A teacher that answers with the item's reference turns (a test double, not a mock of a real
    service: it implements the Teacher protocol). It recognizes the item by its user message and
    the turn by the number of tool results already in the conversation."""

    def __init__(self, items: list[dict[str, Any]], tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.model_id = "replay"
        self.turns = {}
        for item in items:
            body = item["reference"].split("<|tool_result|>")
            turns = [body[0]] + [part.split("<|assistant|>", 1)[1] for part in body[1:]]
            self.turns[item["messages"][1]["content"]] = [t.split(END, 1)[0] for t in turns]
        self.calls = 0

    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        top_k: int,
        temperature: float = 0.0,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnResult:
        self.calls += 1
        text = self.turns[messages[1]["content"]][sum(m["role"] == "tool" for m in messages)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return TurnResult(
            text=text,
            token_ids=ids,
            topk_ids=[[i] for i in ids],
            topk_logprobs=[[0.0] for _ in ids],
            finish_reason="stop",
            request_id=f"replay-{self.calls}",
            prompt_tokens=10,
            completion_tokens=len(ids) + 1,
        )


def byte_bpe(texts: list[str], vocab_size: int, full_alphabet: bool = True) -> Any:
    """A second real tokenizer, unlike :func:`~distillgates.tokenizer.train_tokenizer`'s: a byte-level BPE
    with GPT-2's own split (words absorb their leading space: `` Paris`` is one token, never one of
    ours). ``full_alphabet=False`` keeps only the bytes the corpus has (an ASCII corpus: no byte >= 0x80)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from distillgates.tokenizer import SPECIAL_TOKENS, wrap_tokenizer

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    backend.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(backend)


@pytest.fixture(scope="session")
def other_tokenizer() -> Any:
    """A teacher's tokenizer that is not the student's (:func:`byte_bpe`, another vocabulary size),
    trained on English conversations only, without the full byte alphabet: all its tokens are whole
    ASCII, so whatever a random teacher generates with it is valid text."""
    corpus = [render_conversation(it) for it in generate_items(seed=1, n=60, locales=["en"], split="train")]
    return byte_bpe(corpus, vocab_size=600, full_alphabet=False)
