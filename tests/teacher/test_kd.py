"""KD-set builder: records, cache, checkpoint/resume (SIGKILL), corrupted checkpoints, budget, reader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distillgates.data.chat import render_prompt
from distillgates.data.targets import reference_spans
from distillgates.teacher.cache import CacheError, ResponseCache
from distillgates.teacher.kd import KDCheckpointError, KDSetError, build_kd_set, read_kd_set, token_masks

from .conftest import ReplayTeacher, kd_teacher_config


def test_replayed_reference_gives_the_reference_completion(toy_items, tiny_tokenizer, tmp_path):
    """Multi-turn assembly: a teacher that replays the reference turns reproduces the reference."""
    teacher = ReplayTeacher(toy_items, tiny_tokenizer)
    result = build_kd_set(kd_teacher_config(), teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.complete and result.n_done == len(toy_items)
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["total"] == len(toy_items) and header["teacher_model_id"] == "replay"
    for item, record in zip(toy_items, records):
        assert record["id"] == item["id"] and record["prompt_text"] == render_prompt(item)
        assert record["completion_text"] == item["reference"]
        assert record["calls"] == item["expected_calls"] and record["finish"] == "stop"
        assert all(record["fixture_hits"]) and len(record["request_ids"]) == len(item["expected_calls"]) + 1
        offset = len(record["prompt_text"])
        expected = {k: [[a - offset, b - offset] for a, b in v] for k, v in reference_spans(item).items()}
        assert record["spans"] == expected
        masks = token_masks(record, tiny_tokenizer)
        ids = record["completion_ids"]
        generated = [i for i, m in zip(ids, masks["generated"]) if m]
        injected = [i for i, m, top in zip(ids, masks["generated"], record["topk_ids"]) if not m and top]
        assert generated and injected == []  # injected tool results carry no teacher top-k
        for start, end in record["spans"]["tool_name"]:
            name_ids = [i for i, m in zip(ids, masks["tool_name"]) if m]
            assert record["completion_text"][start:end] in tiny_tokenizer.decode(name_ids)


def test_local_teacher_kd_set(tiny_teacher, toy_items, tmp_path):
    cfg = kd_teacher_config()
    result = build_kd_set(cfg, tiny_teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.complete and result.spent_tokens > 0
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["teacher_model_id"] == tiny_teacher.model_id and header["top_k"] == 4
    for record in records:
        ids = record["completion_ids"]
        assert tiny_teacher.tokenizer.decode(ids) == record["completion_text"]
        assert all(len(row) == 4 for row in record["topk_ids"][: cfg.max_new_tokens])
        assert record["request_id"].startswith("local-")


def test_cache_makes_a_rebuild_free_and_identical(tiny_teacher, toy_items, tmp_path):
    cfg = kd_teacher_config()
    first = build_kd_set(
        cfg, tiny_teacher, toy_items, tmp_path / "a.jsonl", cache_dir=tmp_path / "cache", progress=False
    )
    second = build_kd_set(
        cfg, tiny_teacher, toy_items, tmp_path / "b.jsonl", cache_dir=tmp_path / "cache", progress=False
    )
    assert first.cache_hits == 0 and second.cache_hits > 0 and second.spent_tokens == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    (tmp_path / "cache" / "VERSION").write_text("999\n")
    with pytest.raises(CacheError, match="cache version '999'"):
        ResponseCache(tmp_path / "cache")


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    torch.set_num_threads(1)
    from distillgates.config import TeacherConfig
    from distillgates.data.generator import generate_items
    from distillgates.teacher.kd import build_kd_set
    from distillgates.teacher.local import LocalTeacher

    class SlowTeacher:  # the real teacher, slowed so the test can kill the build mid-run
        def __init__(self, inner):
            self.inner, self.model_id, self.tokenizer = inner, inner.model_id, inner.tokenizer
        def complete_batch(self, conversations, **kwargs):
            time.sleep(float(sys.argv[4]))
            return self.inner.complete_batch(conversations, **kwargs)

    cfg = TeacherConfig(kind="local", top_k=4, max_new_tokens=4, max_turns=2, kd_batch_size=2, ckpt_every=2)
    items = generate_items(seed=0, n=int(sys.argv[3]), split="eval")
    teacher = SlowTeacher(LocalTeacher(sys.argv[1]))
    build_kd_set(cfg, teacher, items, sys.argv[2], resume="--resume" in sys.argv, progress=False)
    """
)


def _run_builder(script: Path, teacher_dir: Path, out: Path, n: int, delay: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(script), str(teacher_dir), str(out), str(n), str(delay), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.integration  # KD builds in subprocesses, one killed (~14 s)
def test_sigkill_and_resume_is_byte_identical(tiny_teacher_dir, tmp_path):
    script = tmp_path / "build.py"
    script.write_text(_KILL_SCRIPT)
    n = 10
    reference = tmp_path / "ref.jsonl"
    proc = _run_builder(script, tiny_teacher_dir, reference, n, 0.0)
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()

    out = tmp_path / "kd.jsonl"
    ckpt = Path(f"{out}.ckpt")
    proc = _run_builder(script, tiny_teacher_dir, out, n, 0.4)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # kill once at least one chunk is checkpointed
        if ckpt.exists() and json.loads(ckpt.read_text())["state"]["n_done"] >= 4:
            break
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not out.exists() and Path(f"{out}.partial").exists()
    n_done = json.loads(ckpt.read_text())["state"]["n_done"]
    assert 4 <= n_done < n

    proc = _run_builder(script, tiny_teacher_dir, out, n, 0.0, "--resume")
    assert proc.wait(timeout=300) == 0, proc.stdout.read().decode()
    assert out.read_bytes() == reference.read_bytes()
    assert not ckpt.exists() and not Path(f"{out}.partial").exists()
    _, records = read_kd_set(out)
    assert [r["id"] for r in records] == [f"toy-eval-{i:06d}" for i in range(n)]  # no gaps, no duplicates


def _interrupted_build(teacher, items, out, tokens: int):
    cfg = kd_teacher_config(budget_tokens=tokens)
    return build_kd_set(cfg, teacher, items, out, progress=False)


def test_budget_stops_cleanly_and_resume_completes(tiny_teacher, toy_items, tmp_path):
    full = build_kd_set(kd_teacher_config(), tiny_teacher, toy_items, tmp_path / "full.jsonl", progress=False)
    out = tmp_path / "kd.jsonl"
    stopped = _interrupted_build(tiny_teacher, toy_items, out, tokens=1)
    assert stopped.status == "budget_exhausted" and not stopped.complete
    assert stopped.n_done == 2 and stopped.spent_tokens >= 1  # one chunk, then a clean stop
    assert "budget reached" in stopped.message and "--resume" in stopped.message
    assert not out.exists() and Path(f"{out}.partial").read_bytes().count(b"\n") == 3  # header + 2 records
    resumed = build_kd_set(kd_teacher_config(budget_tokens=10**9), tiny_teacher, toy_items, out, resume=True,
                           progress=False)  # fmt: skip
    assert resumed.complete and resumed.n_done == len(toy_items)
    assert resumed.spent_tokens == full.spent_tokens  # spending carried over in the checkpoint
    assert out.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


def test_budget_in_usd(tiny_teacher, toy_items, tmp_path):
    cfg = kd_teacher_config(budget_usd=0.001, usd_per_1k_prompt_tokens=1.0)
    result = build_kd_set(cfg, tiny_teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.status == "budget_exhausted" and result.spent_usd >= 0.001 and "budget_usd" in result.message


def test_corrupted_checkpoint_is_a_clear_error(tiny_teacher, toy_items, tmp_path):
    out = tmp_path / "kd.jsonl"
    _interrupted_build(tiny_teacher, toy_items, out, tokens=1)
    ckpt = Path(f"{out}.ckpt")
    good = ckpt.read_text()
    ckpt.write_text(good.replace('"n_done": 2', '"n_done": 4'))
    with pytest.raises(KDCheckpointError, match=r"kd.jsonl.ckpt: corrupted checkpoint \(checksum mismatch\)"):
        build_kd_set(kd_teacher_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    ckpt.write_text(good[: len(good) // 2])
    with pytest.raises(KDCheckpointError, match="corrupted checkpoint"):
        build_kd_set(kd_teacher_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    ckpt.write_text(good)
    partial = Path(f"{out}.partial")
    data = partial.read_bytes()
    partial.write_bytes(data[:50] + b"X" + data[51:])
    with pytest.raises(KDCheckpointError, match="do not match checkpoint"):
        build_kd_set(kd_teacher_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    partial.write_bytes(data)
    with pytest.raises(KDCheckpointError, match="another build"):
        build_kd_set(kd_teacher_config(top_k=3), tiny_teacher, toy_items, out, resume=True, progress=False)


def test_reader_names_file_line_and_field(toy_items, tiny_tokenizer, tmp_path):
    path = tmp_path / "kd.jsonl"
    build_kd_set(kd_teacher_config(), ReplayTeacher(toy_items, tiny_tokenizer), toy_items, path, progress=False)
    lines = path.read_text().splitlines()

    def broken(line_no: int, new: str) -> Path:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join([*lines[: line_no - 1], new, *lines[line_no:]]) + "\n")
        return bad

    record = json.loads(lines[2])
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: <line>: invalid JSON"):
        read_kd_set(broken(3, lines[2][:-5]))
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: completion_ids: missing field"):
        read_kd_set(broken(3, json.dumps({k: v for k, v in record.items() if k != "completion_ids"})))
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: topk_ids: has 1 positions"):
        read_kd_set(broken(3, json.dumps({**record, "topk_ids": [[]]})))
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: spans.integration: span \[0, 100000\]"):
        read_kd_set(broken(3, json.dumps({**record, "spans": {**record["spans"], "integration": [[0, 100000]]}})))
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: id: duplicate id"):
        read_kd_set(broken(3, lines[1]))
    with pytest.raises(KDSetError, match=r"bad.jsonl:1: __header__"):
        read_kd_set(broken(1, lines[1]))


def test_duplicate_item_ids_are_refused(toy_items, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="duplicate item id"):
        build_kd_set(kd_teacher_config(), ReplayTeacher(toy_items, tiny_tokenizer), [toy_items[0]] * 2,
                     tmp_path / "kd.jsonl", progress=False)  # fmt: skip


def test_kd_command_line(tiny_teacher_dir, tiny_tokenizer, toy_items, tmp_path, capsys):
    from distillgates.data.dataset import write_dataset
    from distillgates.teacher import kd
    from distillgates.tokenizer import tokenizer_fingerprint

    data = tmp_path / "train.jsonl"
    write_dataset(data, toy_items, tokenizer_fingerprint(tiny_tokenizer), seed=0)
    config = tmp_path / "cfg.yaml"
    config.write_text("teacher: {kind: local, top_k: 3, max_new_tokens: 4, kd_batch_size: 4}\n")
    out = tmp_path / "kd.jsonl"
    args = [
        str(config),
        "--data",
        str(data),
        "--out",
        str(out),
        "--teacher-dir",
        str(tiny_teacher_dir),
        "--no-progress",
    ]
    assert kd.main(args) == 0
    assert "KD set complete: 7 items" in capsys.readouterr().out
    header, records = read_kd_set(out)
    assert [r["id"] for r in records] == [it["id"] for it in toy_items] and header["top_k"] == 3
    assert any(Path(tmp_path / "kd.jsonl.cache").rglob("*.json"))  # default cache next to the output


def test_kd_items_limits_the_kd_set_to_the_first_items(toy_items, tiny_tokenizer, tmp_path):
    """``teacher.kd_items``: the teacher answers the first N training items only; 0 means all."""
    teacher = ReplayTeacher(toy_items, tiny_tokenizer)
    build_kd_set(kd_teacher_config(kd_items=2), teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["total"] == 2 and [r["id"] for r in records] == [i["id"] for i in toy_items[:2]]
    with pytest.raises(ValueError, match="kd_items must be >= 0"):
        kd_teacher_config(kd_items=-1)
