"""A teacher with another tokenizer: its top-k moved onto the student's tokens through bytes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from distillgates.config import APIConfig
from distillgates.teacher.http import HTTPTeacher
from distillgates.teacher.kd import build_kd_set, read_kd_set
from distillgates.teacher.server import TeacherServer
from distillgates.teacher.tokens import TeacherToken, TokenBytes, map_by_bytes
from distillgates.tokenizer import END

from .conftest import ReplayTeacher, kd_config, save_tiny_teacher


def _turn_texts(items: list[dict[str, Any]]) -> list[str]:
    """The assistant turns the teacher writes (what a KD turn's text is)."""
    out = []
    for item in items:
        for part in item["reference"].split("<|tool_result|>"):
            out.append(part.split("<|assistant|>", 1)[-1].split(END, 1)[0])
    return [t for t in out if t]


def _teacher_turn(text: str, tok: Any, tb: TokenBytes, k: int = 4) -> list[TeacherToken]:
    """The teacher's tokens of ``text`` with a top-k: the chosen token (0.5) and k-1 other tokens of its
    vocabulary (0.2, 0.1, ...; they include partial-word and multi-byte ones), 1 - sum outside the top-k."""
    ids = tok.encode(text, add_special_tokens=False)
    turn = []
    for n, i in enumerate(ids):
        others = [(i + 37 * (j + 1) + n) % len(tok) for j in range(k - 1)]
        top = [(tb.by_id[i], math.log(0.5))] + [(tb.by_id[o], math.log(0.2 / (j + 1))) for j, o in enumerate(others)
                                                 if tb.by_id[o] != tb.by_id[i]]  # fmt: skip
        turn.append(TeacherToken(tb.by_id[i], math.log(0.5), top))
    return turn


def test_identity_mapping_is_the_teacher_distribution(tiny_tokenizer, toy_items):
    """Same tokenizer on both sides: the mapping gives back the teacher's ids and top-k exactly."""
    tb = TokenBytes(tiny_tokenizer)
    for text in _turn_texts(toy_items):
        turn = _teacher_turn(text, tiny_tokenizer, tb)
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        mapped = map_by_bytes(text, turn, ids, tb)
        assert mapped is not None and mapped.ids == ids
        for tok, top_ids, top_lps, lost in zip(turn, mapped.topk_ids, mapped.topk_logprobs, mapped.unmatched):
            expected = {tb.to_id[b]: lp for b, lp in tok.top}
            assert dict(zip(top_ids, top_lps)) == pytest.approx(expected, abs=1e-12) and lost == 0.0


def test_two_tokenizers_coverage_and_mass(tiny_tokenizer, other_tokenizer, toy_items):
    """Teacher: the GPT-2-style BPE; student: ours. Every student position gets a distribution (the old
    1:1 rule: almost none), and mapped + unmatched mass is the teacher's top-k mass (1 inside its tokens)."""
    teacher_tb, student_tb = TokenBytes(other_tokenizer), TokenBytes(tiny_tokenizer)
    positions = covered = old_rule = inside = 0
    for text in _turn_texts([it for it in toy_items if it["locale"] == "en"]):
        turn = _teacher_turn(text, other_tokenizer, teacher_tb)
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        mapped = map_by_bytes(text, turn, ids, student_tb)
        assert mapped is not None and mapped.ids == ids
        positions += len(ids)
        covered += sum(1 for row in mapped.topk_ids if row)
        old_rule += len(ids) if all(t.data in student_tb.to_id for t in turn) else 0  # a turn maps 1:1, or none of it
        starts = {sum(len(t.data) for t in turn[:n]) for n in range(len(turn))}
        a = 0
        for own, top_ids, top_lps, lost in zip(ids, mapped.topk_ids, mapped.topk_logprobs, mapped.unmatched):
            assert len(set(top_ids)) == len(top_ids) and own in top_ids  # aggregated; the text's token has mass
            total = sum(map(math.exp, top_lps)) + lost
            if a in starts:  # aligned: the teacher's listed mass, its rest stays the rest
                holder = next(t for n, t in enumerate(turn) if sum(len(u.data) for u in turn[:n]) == a)
                assert total == pytest.approx(sum(math.exp(lp) for _, lp in holder.top), abs=1e-9)
            else:  # inside a teacher token: conditioned on the bytes written
                inside += 1
                assert total == pytest.approx(1.0, abs=1e-9)
            a += len(student_tb.by_id[own])
    assert positions > 300 and inside > 0.1 * positions  # the tokenizations really differ
    assert covered / positions > 0.9
    assert old_rule / positions < 0.1


def test_unmatched_mass_is_kept_apart(tiny_tokenizer, other_tokenizer):
    """A student vocabulary without some bytes (the ASCII-only BPE): a teacher candidate no student token
    prefixes is unmatched mass, not given to any id (the KD loss's rest bucket holds it)."""
    student_tb = TokenBytes(other_tokenizer)
    assert all(b < 0x80 for token in student_tb.by_id for b in token)
    text = "It is sunny."
    ids = other_tokenizer.encode(text, add_special_tokens=False)
    turn = [TeacherToken(b"It", math.log(0.6), [(b"It", math.log(0.6)), ("Ü".encode(), math.log(0.3))]),
            TeacherToken(text[2:].encode(), math.log(0.9), [(text[2:].encode(), math.log(0.9))])]  # fmt: skip
    mapped = map_by_bytes(text, turn, ids, student_tb)
    assert mapped is not None
    assert mapped.unmatched[0] == pytest.approx(0.3)
    assert sum(map(math.exp, mapped.topk_logprobs[0])) == pytest.approx(0.6)
    assert map_by_bytes("It is rainy.", turn, ids, student_tb) is None  # bytes that do not spell the text


def test_kd_builder_reports_coverage(toy_items, tiny_tokenizer, tmp_path):
    """Coverage counts the positions of teacher-written turns only (not injected tool results)."""
    teacher = ReplayTeacher(toy_items, tiny_tokenizer)
    result = build_kd_set(kd_config(), teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    turn_tokens = sum(len(tiny_tokenizer.encode(t, add_special_tokens=False)) for t in _turn_texts(toy_items))
    assert result.positions == turn_tokens and result.coverage == 1.0
    assert "teacher distribution at 100.0%" in result.message


@pytest.mark.integration
def test_api_teacher_with_another_tokenizer(other_tokenizer, tiny_tokenizer, tiny_teacher_dir, toy_items, tmp_path):
    """End to end over a real loopback server: a teacher on the GPT-2-style BPE, a client with our tokenizer.
    Byte mapping: > 90% of the student positions carry a teacher distribution; the old 1:1 rule: ~0."""
    from distillgates.teacher.local import LocalTeacher

    en = [it for it in toy_items if it["locale"] == "en"]
    teacher = LocalTeacher(save_tiny_teacher(tmp_path / "teacher", other_tokenizer))
    results = {}
    with TeacherServer(teacher) as server:
        for map_bytes in (True, False):
            client = HTTPTeacher(APIConfig(base_url=server.base_url), tiny_tokenizer, api_key="", map_bytes=map_bytes)
            out = tmp_path / f"kd_{map_bytes}.jsonl"
            cfg = kd_config("openai", {"base_url": server.base_url}, max_new_tokens=24)
            results[map_bytes] = build_kd_set(cfg, client, en, out, progress=False)
            client.close()
            read_kd_set(out)  # a valid KD set either way
    mapped, old = results[True], results[False]
    assert mapped.positions == old.positions > 50
    assert mapped.coverage > 0.9, mapped.coverage
    assert old.coverage < 0.1, old.coverage
    _, records = read_kd_set(tmp_path / "kd_True.jsonl")
    rows = [row for rec in records for row in rec["topk_ids"] if row]
    assert any(len(row) != 4 for row in rows)  # aggregated rows: not the teacher's k
    assert all(len(row) <= 5 and len(set(row)) == len(row) for row in rows)


@pytest.mark.integration
def test_same_tokenizer_api_kd_set_is_unchanged_by_the_mapping(tiny_teacher, toy_items, tmp_path):
    """A teacher with our tokenizer takes the 1:1 path: the KD set is byte-identical with or without mapping."""
    data = {}
    for map_bytes in (True, False):
        with TeacherServer(tiny_teacher) as server:  # a fresh server each: the same request ids
            client = HTTPTeacher(APIConfig(base_url=server.base_url), tiny_teacher.tokenizer, api_key="",
                                 map_bytes=map_bytes)  # fmt: skip
            out = tmp_path / f"kd_{map_bytes}.jsonl"
            result = build_kd_set(kd_config("openai", {"base_url": server.base_url}), client, toy_items[:3], out,
                                  progress=False)
            client.close()
            data[map_bytes] = out.read_bytes().split(b"\n", 1)[1]  # the header names the server's port
    assert data[True] == data[False]
    assert result.coverage > 0.9
