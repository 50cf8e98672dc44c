"""Training rows: the excess mask of the latency objective (preamble and post-evidence filler)."""

from __future__ import annotations

from typing import Any

import pytest

from distillgates.data.generator import generate_items
from distillgates.train.data import build_row, collate

WIDE = [256, 512]  # the tiny test tokenizer makes long rows: whole answers must fit


def _decode(tok: Any, ids: list[int], positions: list[int]) -> str:
    return tok.decode([ids[q + 1] for q in positions])  # position q predicts token q + 1


def _ids(tok: Any) -> tuple[int, int, int]:
    return tok.pad_token_id or 0, tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|end|>")


@pytest.fixture(scope="module")
def items() -> list[dict[str, Any]]:
    return generate_items(0, 60, split="train")


def test_verbose_tool_item_drops_the_preamble_and_masks_the_filler(artifacts: dict[str, Any], items) -> None:
    tok = artifacts["tokenizer"]
    verbose = [i for i in items if i["kind"] == "single" and i["style"] == "verbose"]
    rows = [build_row(i, tok, WIDE, mask_excess=True) for i in verbose]
    row = next(r for r in rows if r.length <= WIDE[-1])  # the whole answer fits the largest shape
    item = row.item
    preamble = next(i for i in verbose if i["id"] == item["id"])["reference"].split("<|tool_call|>")[0]
    assert preamble and item["reference"].startswith("<|tool_call|>")
    assert tok.decode(row.ids[row.prompt_len :]).startswith("<|tool_call|>")  # trained to call first
    excess = _decode(tok, row.ids, row.excess)
    answer = item["reference"].rsplit("<|assistant|>", 1)[1].split("<|end|>")[0]
    last_fact = max(answer.rfind(f) + len(f) for f in item["integration_fields"])
    assert excess == answer[last_fact:]
    for fact in item["integration_fields"]:
        assert fact not in excess
    batch = collate([row], *_ids(tok))
    for q in row.excess:
        assert batch.ce_mask[0, q] == 0 and batch.kd_mask[0, q] == 0 and batch.turn_mask[0, q]
    assert batch.ce_mask.sum() == batch.turn_mask.sum() - len(row.excess)


def test_terse_and_control_items_keep_their_targets(artifacts: dict[str, Any], items) -> None:
    tok = artifacts["tokenizer"]
    control = next(i for i in items if i["kind"] == "control")
    assert build_row(control, tok, WIDE, mask_excess=True).excess == []
    rows = [build_row(i, tok, WIDE, mask_excess=True) for i in items if i["kind"] == "single" and i["style"] == "terse"]
    row = next(r for r in rows if r.length <= WIDE[-1])
    terse = row.item
    assert _decode(tok, row.ids, row.excess) == "."  # the full stop after the last fact
    assert build_row(terse, tok, WIDE).excess == []  # off by default


def test_kd_record_loses_the_same_preamble(artifacts: dict[str, Any]) -> None:
    from distillgates.train.data import read_kd_set

    tok = artifacts["tokenizer"]
    records = read_kd_set(artifacts["kd_path"])
    call_id = tok.convert_tokens_to_ids("<|tool_call|>")
    item = next(i for i in artifacts["train"] if i["tool_should_be_used"] and not i["reference"].startswith("<|tool"))
    record = records[item["id"]]
    cut = record["completion_ids"].index(call_id)
    row = build_row(item, tok, WIDE, kd=record, mask_excess=True)
    assert cut > 0 and row.ids[row.prompt_len] == call_id
    assert row.kd_ids[0] == record["topk_ids"][cut] and len(row.kd_ids) > 1
    plain = build_row(item, tok, WIDE, kd=record)
    assert plain.kd_ids[0] == record["topk_ids"][0] and plain.teacher_len == row.teacher_len
