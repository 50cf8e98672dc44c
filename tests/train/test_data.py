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


def test_a_kd_set_without_logprobs_trains_on_the_teachers_text(artifacts: dict[str, Any], tmp_path) -> None:
    """Sequence-level KD: header ``logprobs: false`` -> the row is the prompt + the teacher's text
    (student tokens), CE over its assistant turns; an unfinished conversation keeps the reference."""
    import json

    from distillgates.data.chat import render_prompt
    from distillgates.train.data import read_kd_set

    tok = artifacts["tokenizer"]
    lines = artifacts["kd_path"].read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])  # a set with top-k (no "logprobs" field: written before the switch)
    assert not any(r["sequence_level"] for r in read_kd_set(artifacts["kd_path"]).values())
    text_only = tmp_path / "kd.jsonl"
    text_only.write_text("\n".join([json.dumps({**header, "logprobs": False}), *lines[1:]]) + "\n", encoding="utf-8")
    records = read_kd_set(text_only)
    item = next(i for i in artifacts["train"] if i["kind"] == "single")
    record = records[item["id"]] | {"finish": "stop"}
    answer = item["reference"].rsplit("<|assistant|>", 1)[1]
    teacher_text = item["reference"].removesuffix(answer) + "Teacher wording here.<|end|><|eos|>"
    record["completion_text"] = teacher_text
    row = build_row(item, tok, WIDE, kd=record)
    assert record["sequence_level"] and row.kd_ids == [] and row.process == []
    assert tok.decode(row.ids[: row.prompt_len]) == render_prompt(item)
    assert tok.decode(row.ids[row.prompt_len :]) == teacher_text
    batch = collate([row], *_ids(tok))
    trained = tok.decode([row.ids[q + 1] for q in batch.ce_mask[0].nonzero().flatten().tolist()])
    assert "Teacher wording here.<|end|>" in trained and batch.kd_ids is None
    assert "<|tool_result|>" not in trained  # injected tool results are not the model's to predict
    unfinished = build_row(item, tok, WIDE, kd=record | {"finish": "length"})
    assert tok.decode(unfinished.ids[unfinished.prompt_len :]) == item["reference"]


def test_short_topk_rows_are_padded_not_dropped(artifacts: dict[str, Any]) -> None:
    """Top-k rows shorter than the batch's k (a teacher with another tokenizer, mapped through bytes) keep
    their KD position; the padded slots carry -inf log-probs (left out by the loss), [] rows stay unmasked."""
    import math

    tok = artifacts["tokenizer"]
    item = artifacts["train"][0]
    row = build_row(item, tok, WIDE)
    row.kd_ids, row.kd_logprobs = [[5, 6, 7], [8], []], [[-0.5, -1.5, -2.5], [-0.1], []]
    batch = collate([row], *_ids(tok))
    s = row.prompt_len - 1  # the position that predicts the first completion token
    assert batch.kd_ids is not None and batch.kd_logprobs is not None
    assert batch.kd_ids[0, s + 1, 0] == 8 and batch.kd_logprobs[0, s + 1, 0] == -0.1
    assert batch.kd_logprobs[0, s + 1, 1:].tolist() == [-math.inf, -math.inf]
    assert batch.kd_mask[0, s : s + 3].tolist() == [1.0, 1.0, 0.0]
