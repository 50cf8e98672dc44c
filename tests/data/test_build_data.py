"""End-to-end toy data build: tokenizer + train/eval JSONL that read back with matching headers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distillgates.config import Config, DataConfig, ShapesConfig, TokenizerConfig
from distillgates.data.build import build_data
from distillgates.data.chat import render_conversation
from distillgates.data.dataset import read_dataset
from distillgates.data.fingerprints import dataset_sha256
from distillgates.tokenizer import encode, load_tokenizer, tokenizer_fingerprint

CFG = Config(
    tokenizer=TokenizerConfig(vocab_size=768),
    data=DataConfig(seed=1, n_train=200, n_eval=40),
    shapes=ShapesConfig(lengths=[128, 192, 256], mix=[0.5, 0.35, 0.15]),
)


def test_build_reads_back_and_is_deterministic(tmp_path):
    first = build_data(CFG, tmp_path / "a")
    tok = load_tokenizer(first.tokenizer_dir)
    assert tokenizer_fingerprint(tok) == first.tokenizer_fingerprint
    for split, path in (("train", first.train), ("eval", first.eval)):
        header, items = read_dataset(path, tokenizer_fingerprint(tok))
        assert header["seed"] == 1 and header["total"] == len(items)
        assert len(items) + len(first.dropped[split]) == {"train": 200, "eval": 40}[split]
        assert all(len(encode(tok, render_conversation(item))) <= 256 for item in items)
        assert sum(first.shape_counts[split].values()) == len(items)
        assert dataset_sha256(path) == first.dataset_sha256[split]
    train_ids = {item["id"] for item in read_dataset(first.train)[1]}
    assert not train_ids & {item["id"] for item in read_dataset(first.eval)[1]}
    second = build_data(CFG, tmp_path / "b")
    assert second.dataset_sha256 == first.dataset_sha256
    assert second.tokenizer_fingerprint == first.tokenizer_fingerprint


def test_tokenizer_path_is_loaded_and_its_tool_call_format_saved_with_it(tmp_path):
    """``tokenizer.path``: a Hugging Face tokenizer directory (here a ChatML one saved by the test) is used as
    is, not trained; ``tokenizer.tool_call_format`` travels with it into ``data/tokenizer``."""
    from distillgates.data.chat import chat_format, template_chat_format
    from distillgates.data.openai_format import read_items
    from distillgates.tokenizer import CHATML_CHAT_TEMPLATE, save_tokenizer, train_tokenizer

    from ..conftest import own_data_rows, write_jsonl

    write_jsonl(tmp_path / "rows.jsonl", own_data_rows(4))
    texts = [template_chat_format("chatml").conversation(item) for item in read_items(tmp_path / "rows.jsonl")]
    source = save_tokenizer(train_tokenizer(texts, vocab_size=500, chat_template="chatml"), tmp_path / "given")
    cfg = Config(
        tokenizer=TokenizerConfig(path=str(source), tool_call_format="hermes"),
        data=DataConfig(source="jsonl", path=str(tmp_path / "rows.jsonl"), eval_fraction=0.25),
        shapes=ShapesConfig(lengths=[256, 512], mix=[0.5, 0.5]),
    )
    build = build_data(cfg, tmp_path / "data")
    tok = load_tokenizer(build.tokenizer_dir)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(load_tokenizer(source)) == build.tokenizer_fingerprint
    assert tok.chat_template == CHATML_CHAT_TEMPLATE and tok.init_kwargs["tool_call_format"] == "hermes"
    fmt = chat_format(tok)
    _, items = read_dataset(build.train, build.tokenizer_fingerprint)
    assert all(fmt.prompt(item).endswith("<|im_start|>assistant\n") for item in items)



def test_eval_min_per_shape_tops_up_the_eval_split_only(tmp_path):
    """``data.eval_min_per_shape``: the first ``n_eval`` eval items, then further generated tool items of the shapes
    holding fewer than that many tool items, until none does; the train split and the tokenizer are unchanged."""
    from distillgates.data.chat import chat_format
    from distillgates.data.dataset import drawn_items
    from distillgates.data.shapes import bucket_of

    plain = build_data(CFG, tmp_path / "plain")
    topped = build_data(replace(CFG, data=replace(CFG.data, eval_min_per_shape=6)), tmp_path / "topped")
    assert topped.tokenizer_fingerprint == plain.tokenizer_fingerprint
    assert topped.dataset_sha256["train"] == plain.dataset_sha256["train"]
    first, items = read_dataset(plain.eval)[1], read_dataset(topped.eval)[1]
    assert items[: len(first)] == first
    fmt = chat_format(load_tokenizer(topped.tokenizer_dir))

    def tool_items(items):
        held = dict.fromkeys(CFG.shapes.lengths, 0)
        for item in items:
            held[bucket_of(len(fmt.encode(fmt.conversation(item))), CFG.shapes.lengths)] += item["tool_should_be_used"]
        return held

    before = tool_items(first)
    assert min(before.values()) < 6  # the test tops up something
    assert tool_items(items) == {shape: max(n, 6) for shape, n in before.items()}
    assert all(item["tool_should_be_used"] for item in items[len(first):])
    assert sum(topped.shape_counts["eval"].values()) == len(items)
    assert drawn_items(items) == first  # the top-up is marked: the quality figures leave it out


def test_eval_min_per_shape_that_no_item_can_fill_is_an_error(tmp_path):
    cfg = replace(CFG, data=replace(CFG.data, eval_min_per_shape=1), shapes=ShapesConfig(lengths=[40, 256],
                                                                                          mix=[0.5, 0.5]))
    with pytest.raises(ValueError, match=r"data.eval_min_per_shape: 1: .*\{40: 0\}"):
        build_data(cfg, tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_eval_min_per_shape_needs_the_toy_generator():
    with pytest.raises(ValueError, match=r"eval_min_per_shape .* needs source 'toy'"):
        DataConfig(source="jsonl", path="rows.jsonl", eval_min_per_shape=10)
