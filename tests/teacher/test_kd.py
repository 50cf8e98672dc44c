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

from distillgates.data.chat import parse_assistant_turn, render_prompt, tool_call_text
from distillgates.eval.runners import TeacherRunner, run_item
from distillgates.teacher.base import TurnResult
from distillgates.teacher.cache import CacheError, ResponseCache
from distillgates.teacher.kd import KDCheckpointError, KDSetError, build_kd_set, read_kd_set
from distillgates.tokenizer import END

from .conftest import ReplayTeacher, kd_config


def test_replayed_reference_gives_the_reference_completion(toy_items, tiny_tokenizer, tmp_path):
    """Multi-turn assembly: a teacher that replays the reference turns reproduces the reference."""
    teacher = ReplayTeacher(toy_items, tiny_tokenizer)
    result = build_kd_set(kd_config(), teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.complete and result.n_done == len(toy_items)
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["total"] == len(toy_items) and header["teacher_model_id"] == "replay"
    for item, record in zip(toy_items, records):
        assert record["id"] == item["id"] and record["prompt_text"] == render_prompt(item)
        assert record["completion_text"] == item["reference"]
        assert record["calls"] == item["expected_calls"] and record["finish"] == "stop"
        assert all(record["fixture_hits"]) and len(record["request_ids"]) == len(item["expected_calls"]) + 1
        assert record["answer"] == item["reference"].rsplit("<|assistant|>", 1)[-1].removesuffix("<|end|><|eos|>")
        # the teacher's tokens carry its top-k; injected tool results, <|eos|> (and the replay's <|end|>) none
        with_topk = [i for i, top in zip(record["completion_ids"], record["topk_ids"]) if top]
        assert tiny_tokenizer.decode(with_topk) == "".join(teacher.turns[item["messages"][1]["content"]])


class ShoutingTeacher(ReplayTeacher):
    """Replays the reference but writes every string argument in upper case with spaces around it."""

    def complete(self, messages, **kwargs) -> TurnResult:
        turn = super().complete(messages, **kwargs)
        call = parse_assistant_turn(turn.text)
        if isinstance(call, dict):
            args = {k: f" {v.upper()} " if isinstance(v, str) else v for k, v in call["arguments"].items()}
            turn.text = tool_call_text({**call, "arguments": args}).removesuffix(END)
            turn.token_ids = self.tokenizer.encode(turn.text, add_special_tokens=False)
            turn.topk_ids, turn.topk_logprobs = [[i] for i in turn.token_ids], [[0.0] for _ in turn.token_ids]
        return turn


def test_kd_conversations_are_the_eval_loop(toy_items, tiny_tokenizer, tmp_path):
    """The KD builder plays each conversation through the eval loop: arguments match fixtures as the
    broker normalizes them (case, spaces), and calls, answer and hits equal what run_item records."""
    cfg = kd_config()
    teacher = ShoutingTeacher(toy_items, tiny_tokenizer)
    build_kd_set(cfg, teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    _, records = read_kd_set(tmp_path / "kd.jsonl")
    shouted = [r for r in records if any(isinstance(v, str) for c in r["calls"] for v in c["arguments"].values())]
    assert shouted, "toy items should include calls with string arguments"
    for item, record in zip(toy_items, records):
        assert record["finish"] == "stop" and all(record["fixture_hits"])
        for fixture in item["fixtures"]:  # every tool result reached the teacher, not a miss
            assert json.dumps(fixture["result"], separators=(",", ":"), ensure_ascii=False) in record["completion_text"]
        output = run_item(item, TeacherRunner(teacher).session(), max_calls=cfg.kd.max_turns)
        assert [c["call"] for c in output["calls"]] == record["calls"] and output["answer"] == record["answer"]
        assert [c["fixture_hit"] for c in output["calls"]] == record["fixture_hits"]


def test_an_unparsable_call_gets_an_error_result_and_the_teacher_goes_on(toy_items, tiny_tokenizer, tmp_path):
    """As in evaluation, a broken call is answered with an error result, never dispatched."""

    class Stutter(ReplayTeacher):  # a broken call first, then the reference turns
        def complete(self, messages, **kwargs) -> TurnResult:
            turn = super().complete(messages[:2] + messages[4:], **kwargs)
            if len(messages) == 2:
                turn.text = '<|tool_call|>{"name":'
                turn.token_ids = self.tokenizer.encode(turn.text, add_special_tokens=False)
                turn.topk_ids = turn.topk_logprobs = [[] for _ in turn.token_ids]
            return turn

    items = [it for it in toy_items if it["kind"] == "single"]
    build_kd_set(kd_config(max_turns=3), Stutter(items, tiny_tokenizer), items, tmp_path / "kd.jsonl",
                 progress=False)  # fmt: skip
    _, records = read_kd_set(tmp_path / "kd.jsonl")
    for item, record in zip(items, records):
        assert record["calls"] == [None, *item["expected_calls"]] and record["fixture_hits"] == [None, True]
        assert record["completion_text"].startswith('<|tool_call|>{"name":<|end|><|tool_result|>{"error":')
        assert record["completion_text"].endswith(item["reference"]) and record["finish"] == "stop"


def test_local_teacher_kd_set(tiny_teacher, toy_items, tmp_path):
    cfg = kd_config()
    result = build_kd_set(cfg, tiny_teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.complete and result.spent_tokens > 0
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["teacher_model_id"] == tiny_teacher.model_id and header["top_k"] == 4
    for record in records:
        ids = record["completion_ids"]
        assert tiny_teacher.tokenizer.decode(ids) == record["completion_text"]
        assert all(len(row) == 4 for row in record["topk_ids"][: cfg.kd.max_new_tokens])
        assert record["request_id"].startswith("local-")


def test_cache_makes_a_rebuild_free_and_identical(tiny_teacher, toy_items, tmp_path):
    cfg = kd_config()
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
    from distillgates.config import Config, KDConfig
    from distillgates.data.generator import generate_items
    from distillgates.teacher.base import BatchTeacher
    from distillgates.teacher.kd import build_kd_set
    from distillgates.teacher.local import LocalTeacher

    class SlowTeacher(BatchTeacher):  # the real teacher, slowed so the test can kill the build mid-run
        def __init__(self, inner):
            self.inner, self.model_id, self.tokenizer = inner, inner.model_id, inner.tokenizer
        def complete_batch(self, conversations, **kwargs):
            time.sleep(float(sys.argv[4]))
            return self.inner.complete_batch(conversations, **kwargs)

    cfg = Config(kd=KDConfig(top_k=4, max_new_tokens=4, max_turns=2, batch_size=2, ckpt_every=2))
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
    cfg = kd_config(budget_tokens=tokens)
    return build_kd_set(cfg, teacher, items, out, progress=False)


def test_budget_stops_cleanly_and_resume_completes(tiny_teacher, toy_items, tmp_path):
    full = build_kd_set(kd_config(), tiny_teacher, toy_items, tmp_path / "full.jsonl", progress=False)
    out = tmp_path / "kd.jsonl"
    stopped = _interrupted_build(tiny_teacher, toy_items, out, tokens=1)
    assert stopped.status == "budget_exhausted" and not stopped.complete
    assert stopped.n_done == 2 and stopped.spent_tokens >= 1  # one chunk, then a clean stop
    assert "budget reached" in stopped.message and "distillgates kd" in stopped.message
    assert not out.exists() and Path(f"{out}.partial").read_bytes().count(b"\n") == 3  # header + 2 records
    resumed = build_kd_set(kd_config(budget_tokens=10**9), tiny_teacher, toy_items, out, resume=True,
                           progress=False)  # fmt: skip
    assert resumed.complete and resumed.n_done == len(toy_items)
    assert resumed.spent_tokens == full.spent_tokens  # spending carried over in the checkpoint
    assert out.read_bytes() == (tmp_path / "full.jsonl").read_bytes()


def test_budget_in_usd(tiny_teacher, toy_items, tmp_path):
    cfg = kd_config(budget_usd=0.001, usd_per_1k_prompt_tokens=1.0)
    result = build_kd_set(cfg, tiny_teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    assert result.status == "budget_exhausted" and result.spent_usd >= 0.001 and "budget_usd" in result.message


def test_corrupted_checkpoint_is_a_clear_error(tiny_teacher, toy_items, tmp_path):
    out = tmp_path / "kd.jsonl"
    _interrupted_build(tiny_teacher, toy_items, out, tokens=1)
    ckpt = Path(f"{out}.ckpt")
    good = ckpt.read_text()
    ckpt.write_text(good.replace('"n_done": 2', '"n_done": 4'))
    with pytest.raises(KDCheckpointError, match=r"kd.jsonl.ckpt: corrupted checkpoint \(checksum mismatch\)"):
        build_kd_set(kd_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    ckpt.write_text(good[: len(good) // 2])
    with pytest.raises(KDCheckpointError, match="corrupted checkpoint"):
        build_kd_set(kd_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    ckpt.write_text(good)
    partial = Path(f"{out}.partial")
    data = partial.read_bytes()
    partial.write_bytes(data[:50] + b"X" + data[51:])
    with pytest.raises(KDCheckpointError, match="do not match checkpoint"):
        build_kd_set(kd_config(), tiny_teacher, toy_items, out, resume=True, progress=False)
    partial.write_bytes(data)
    with pytest.raises(KDCheckpointError, match="another build"):
        build_kd_set(kd_config(top_k=3), tiny_teacher, toy_items, out, resume=True, progress=False)


def test_reader_names_file_line_and_field(toy_items, tiny_tokenizer, tmp_path):
    path = tmp_path / "kd.jsonl"
    build_kd_set(kd_config(), ReplayTeacher(toy_items, tiny_tokenizer), toy_items, path, progress=False)
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
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: topk_ids\[0\]: top-k ids and log-probs must be lists of equal"):
        read_kd_set(broken(3, json.dumps({**record, "topk_logprobs": [[], *record["topk_logprobs"][1:]]})))
    with pytest.raises(KDSetError, match=r"bad.jsonl:3: id: duplicate id"):
        read_kd_set(broken(3, lines[1]))
    with pytest.raises(KDSetError, match=r"bad.jsonl:1: __header__"):
        read_kd_set(broken(1, lines[1]))


def test_duplicate_item_ids_are_refused(toy_items, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="duplicate item id"):
        build_kd_set(kd_config(), ReplayTeacher(toy_items, tiny_tokenizer), [toy_items[0]] * 2,
                     tmp_path / "kd.jsonl", progress=False)  # fmt: skip


def test_kd_items_limits_the_kd_set_to_the_first_items(toy_items, tiny_tokenizer, tmp_path):
    """``kd.items``: the teacher answers the first N training items only; 0 means all."""
    teacher = ReplayTeacher(toy_items, tiny_tokenizer)
    build_kd_set(kd_config(items=2), teacher, toy_items, tmp_path / "kd.jsonl", progress=False)
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["total"] == 2 and [r["id"] for r in records] == [i["id"] for i in toy_items[:2]]
    with pytest.raises(ValueError, match="items must be >= 0"):
        kd_config(items=-1)
