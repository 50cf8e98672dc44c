"""Training rows: what the latency objective calls excess (the preamble and the filler after the facts)."""

from __future__ import annotations

from typing import Any

import pytest

from distillgates.data.generator import generate_items
from distillgates.train.data import build_row, collate

WIDE = [256, 512]  # the tiny test tokenizer makes long rows: whole answers must fit


def _ids(tok: Any) -> tuple[int, int, int]:
    return tok.pad_token_id or 0, tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|end|>")


def _record(tok: Any, completion: list[int]) -> dict[str, Any]:
    """A finished KD record whose teacher said ``completion``, each token its own top-1."""
    return {"completion_ids": completion, "topk_ids": [[t] for t in completion],
            "topk_logprobs": [[0.0] for _ in completion], "completion_text": tok.decode(completion), "finish": "stop"}


@pytest.fixture(scope="module")
def items() -> list[dict[str, Any]]:
    return generate_items(0, 60, split="train")


def _answer(item: dict[str, Any]) -> str:
    return item["reference"].rsplit("<|assistant|>", 1)[-1].split("<|end|>")[0]


def test_without_filler_ends_the_answer_with_the_sentence_of_its_last_fact(items) -> None:
    from distillgates.data.generator import _FILLERS
    from distillgates.train.data import without_filler

    fillers = [f for pool in _FILLERS.values() for f in pool]
    tool_items = [i for i in items if i["tool_should_be_used"]]
    assert {i["style"] for i in tool_items} == {"verbose", "terse"} and any(i["kind"] == "multi" for i in tool_items)
    for item in tool_items:
        cut = without_filler(item)
        answer = _answer(cut)
        assert answer.endswith(".") and all(fact in answer for fact in item["integration_fields"])
        assert not any(f in answer for f in fillers), answer
        assert cut["reference"].endswith("<|end|><|eos|>")
        if item["style"] == "terse":
            assert cut == item  # nothing follows the facts
        else:
            assert _answer(item) == f"{answer} {next(f for f in fillers if _answer(item).endswith(f))}"
    control = next(i for i in items if i["kind"] == "control" and i["style"] == "verbose")
    assert without_filler(control) == control  # no evidence: no cut


def test_verbose_tool_item_drops_the_preamble_and_the_filler(artifacts: dict[str, Any], items) -> None:
    tok = artifacts["tokenizer"]
    verbose = [i for i in items if i["kind"] == "single" and i["style"] == "verbose"]
    rows = [build_row(i, tok, WIDE, mask_excess=True) for i in verbose]
    row = next(r for r in rows if r.length <= WIDE[-1])  # the whole answer fits the largest shape
    item = row.item
    original = next(i for i in verbose if i["id"] == item["id"])
    preamble = original["reference"].split("<|tool_call|>")[0]
    assert preamble and item["reference"].startswith("<|tool_call|>")
    text = tok.decode(row.ids[row.prompt_len :])
    assert text.startswith("<|tool_call|>")  # trained to call first
    facts = _answer(item)
    assert facts != _answer(original) and _answer(original).startswith(facts)
    assert text.replace(" ", "").endswith((facts + "<|end|><|eos|>").replace(" ", ""))  # the facts, then the end
    assert row.excess == []
    batch = collate([row], *_ids(tok))
    end_at = max(j for j, t in enumerate(row.ids) if t == _ids(tok)[2])
    assert batch.ce_mask[0, end_at - 1] == 1  # the position after the sentence predicts the end of the turn
    assert batch.ce_mask.sum() == batch.turn_mask.sum()
    assert build_row(original, tok, WIDE).item == original  # off by default


def test_terse_and_control_items_keep_their_targets(artifacts: dict[str, Any], items) -> None:
    tok = artifacts["tokenizer"]
    control = next(i for i in items if i["kind"] == "control")
    assert build_row(control, tok, WIDE, mask_excess=True).excess == []
    rows = [build_row(i, tok, WIDE, mask_excess=True) for i in items if i["kind"] == "single" and i["style"] == "terse"]
    row = next(r for r in rows if r.length <= WIDE[-1])
    assert row.excess == [] and _answer(row.item) in tok.decode(row.ids[row.prompt_len :])


def test_no_kd_where_the_filler_was_cut(artifacts: dict[str, Any], items) -> None:
    """A teacher that says the facts' sentence and goes on with the filler: KD up to the sentence's end, not
    at the end of the turn the row now predicts there (the teacher's next token is filler)."""
    from distillgates.data.targets import encode_item
    from distillgates.train.data import without_preamble

    tok = artifacts["tokenizer"]
    end = _ids(tok)[2]
    item = next(i for i in items if i["kind"] == "single" and i["style"] == "verbose"
                and len(encode_item(tok, i).input_ids) <= WIDE[-1])
    said = encode_item(tok, without_preamble(item))  # the teacher, filler and all (no preamble to cut)
    completion = said.input_ids[said.prompt_len :]
    record = _record(tok, completion)
    row = build_row(item, tok, WIDE, kd=record, mask_excess=True)
    answer_end = max(j for j, t in enumerate(row.ids) if t == end) - row.prompt_len  # the row's <|end|> after the facts
    assert completion[answer_end] != end  # the teacher's filler where the row ends the turn
    assert row.kd_ids == record["topk_ids"][:answer_end]  # KD on everything the teacher said before it


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


def test_no_kd_where_the_teacher_departs_from_a_call_or_a_fact(artifacts: dict[str, Any], items) -> None:
    """A teacher that writes a wrong operand: KD on the call up to it, not at it (its distribution there would teach
    the wrong value the reference's CE contradicts); a departure in plain text keeps its KD position."""
    from distillgates.data.targets import encode_item

    tok = artifacts["tokenizer"]
    item = next(i for i in items if i["kind"] == "single" and i["style"] == "terse"
                and i["expected_calls"][0]["name"] == "calculate" and len(encode_item(tok, i).input_ids) <= WIDE[-1])
    enc = encode_item(tok, item)
    completion = enc.input_ids[enc.prompt_len :]
    at = next(j for j in range(enc.prompt_len, len(enc.input_ids)) if enc.masks["arguments"][j]) - enc.prompt_len
    wrong = list(completion)
    wrong[at] = next(t for t in tok.encode("7 9", add_special_tokens=False) if t != completion[at])
    record = _record(tok, wrong)
    row = build_row(item, tok, WIDE, kd=record, mask_excess=True)
    assert row.kd_ids == record["topk_ids"][:at]  # up to the operand, not the teacher's wrong one
    control = next(i for i in items if i["kind"] == "control" and len(encode_item(tok, i).input_ids) <= WIDE[-1])
    enc = encode_item(tok, control)
    said = list(enc.input_ids[enc.prompt_len :])
    said[1] = next(t for t in tok.encode("maybe so", add_special_tokens=False) if t != said[1])
    record = _record(tok, said)
    assert build_row(control, tok, WIDE, kd=record, mask_excess=True).kd_ids == record["topk_ids"][:2]
