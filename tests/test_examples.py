"""examples/own-data: its config validates, its committed data is what its generator writes, and reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from distillgates.config import load_config
from distillgates.data.openai_format import read_items

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own-data"


def test_own_data_example_config_and_data():
    cfg = load_config(EXAMPLE / "config.yaml")
    assert cfg.data.source == "jsonl" and cfg.eval.privacy.allow == ["create_ticket.reporter"]
    assert cfg.tokenizer.chat_template == "chatml" and cfg.student.max_seq_len >= max(cfg.shapes.lengths)
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    for split in ("train", "eval"):
        path = EXAMPLE / f"{split}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == make_data.rows_of(split)
        items = read_items(path)
        kinds = {item["kind"] for item in items}
        assert {"single", "multi", "control", "decline"} <= kinds
        assert any(len(item["messages"]) > 2 for item in items)  # multi-turn history
        assert any(item.get("parallel_calls") for item in items)
        names = {call["name"] for item in items for call in item["expected_calls"]}
        assert names == {"create_ticket", "search_files", "ticket_status"}
