"""A local Hugging Face teacher whose tokenizer is not the student's: the KD set is on the student's tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from distillgates.config import Config, KDConfig, TeacherConfig
from distillgates.data.chat import chat_format
from distillgates.data.dataset import write_dataset
from distillgates.rundir import RunDir
from distillgates.teacher.base import TurnResult
from distillgates.teacher.kd import read_kd_set
from distillgates.tokenizer import save_tokenizer, tokenizer_fingerprint

from .conftest import save_tiny_teacher


def _run_dir(root: Path, student: Any, teacher: Any, items: list[dict[str, Any]]) -> tuple[Config, RunDir]:
    """A run directory with the data step's outputs (the student's tokenizer, the train split) and a
    config whose local teacher (``teacher.path``) has ``teacher``'s tokenizer."""
    save_tokenizer(student, root / "data" / "tokenizer")
    write_dataset(root / "data" / "train.jsonl", items, tokenizer_fingerprint(student), seed=0)
    teacher_dir = save_tiny_teacher(root / "hf_teacher", teacher)
    kd = KDConfig(top_k=4, max_new_tokens=24, max_turns=3, batch_size=2, ckpt_every=2)
    return Config(teacher=TeacherConfig(kind="local", path=str(teacher_dir)), kd=kd), RunDir(root)


@pytest.mark.integration
def test_local_teacher_with_another_tokenizer_kd_set_is_on_student_tokens(
    tiny_tokenizer, other_tokenizer, toy_items, tmp_path
):
    """The KD step with a local teacher on the GPT-2-style BPE and a student on ours: the set's header,
    ids and top-k are the student's (main wrote the teacher's ids, a silently wrong set), > 90% of the
    student positions carry a teacher distribution, the student trains on it, and the teacher is evaluated
    on the student's tokens."""
    from distillgates.pipeline import step_kd
    from distillgates.train.recipe import train_student

    from ..train.conftest import tiny_config

    en = [it for it in toy_items if it["locale"] == "en"]
    cfg, run = _run_dir(tmp_path / "run", tiny_tokenizer, other_tokenizer, en)
    step_kd(cfg, run)
    header, records = read_kd_set(run.kd_set)
    assert header["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny_tokenizer)
    fmt, V = chat_format(tiny_tokenizer), len(tiny_tokenizer)
    for rec in records:
        assert rec["prompt_text"] == fmt.prompt(next(it for it in en if it["id"] == rec["id"]))
        assert tiny_tokenizer.decode(rec["completion_ids"], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False) == rec["completion_text"]  # fmt: skip
        for row, lps in zip(rec["topk_ids"], rec["topk_logprobs"]):
            assert all(0 <= i < V for i in row) and len(set(row)) == len(row)
            assert sum(map(math.exp, lps)) <= 1 + 1e-4
    build = json.loads(run.kd_build.read_text())
    assert build["kd_positions"] > 50
    assert build["kd_coverage"] > 0.9, build
    rows = [row for rec in records for row in rec["topk_ids"] if row]
    assert any(len(row) != 4 for row in rows)  # moved through bytes: aggregated rows, not the teacher's k
    train = tiny_config(V, steps=2, warmup_steps=1, batch_size=2)
    path = train_student(train, "student", tmp_path / "out", kd_path=run.kd_set, tokenizer=tiny_tokenizer,
                         train_items=en, eval_items=en[:1], progress=False, device="cpu")  # fmt: skip
    assert path.exists()
    # the eval step's teacher run: a teacher session on the student's tokens and format (as an API teacher's)
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.runners import TeacherRunner
    from distillgates.teacher.local import StudentTokensTeacher, local_teacher

    teacher = local_teacher(run.teacher_model_dir(cfg), tiny_tokenizer)
    assert isinstance(teacher, StudentTokensTeacher) and teacher.model_id == header["teacher_model_id"]
    quality, outputs, _ = evaluate(TeacherRunner(teacher, 16), en, tiny_tokenizer, max_new_tokens=16, progress=False,
                                   return_outputs=True)  # fmt: skip
    assert len(outputs) == len(en) and 0.0 <= quality["tool_selection"] <= 1.0


def test_teacher_turn_with_a_call_renders_in_the_students_format(tiny_tokenizer, chatml_tokenizer):
    """A toy-format teacher's call, seen by a ChatML student: the turn is the student's Hermes ``<tool_call>``
    block (the teacher's bytes do not spell it: text-only, as the API path does), the call is structured
    (so the teacher's own template renders it in the next prompt); a plain answer keeps its distribution."""
    from distillgates.teacher.local import Generation, student_turn
    from distillgates.teacher.tokens import TokenBytes

    teacher_fmt, student_fmt = chat_format(tiny_tokenizer), chat_format(chatml_tokenizer)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}

    def generation(text: str) -> Generation:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        return Generation(text=text, token_ids=ids, topk_ids=[[i] for i in ids], topk_logprobs=[[-0.1] for _ in ids],
                          token_logprobs=[-0.1 for _ in ids], finish_reason="stop", stop_topk_ids=[],
                          stop_topk_logprobs=[])  # fmt: skip

    base = TurnResult(text="", token_ids=None, topk_ids=[], topk_logprobs=[], finish_reason="stop",
                      request_id="r", prompt_tokens=1, completion_tokens=1)  # fmt: skip
    args = (teacher_fmt, TokenBytes(tiny_tokenizer), student_fmt, TokenBytes(chatml_tokenizer))
    turn = student_turn(generation(teacher_fmt.call_text(call)), base, *args)
    assert turn.text == student_fmt.call_text(call) and "<tool_call>" in turn.text
    assert turn.token_ids is None and turn.topk_ids == []  # text-only
    assert [(c["name"], json.loads(c["arguments"])) for c in turn.tool_calls] == [("get_weather", {"city": "Paris"})]
    answer = student_turn(generation("It is sunny in Paris."), base, *args)
    assert answer.text == "It is sunny in Paris." and answer.tool_calls == []
    assert answer.token_ids == chatml_tokenizer.encode(answer.text, add_special_tokens=False)
    assert all(row for row in answer.topk_ids)


def test_training_refuses_a_kd_set_on_another_tokenizer(tiny_tokenizer, other_tokenizer, toy_items, tmp_path):
    """A KD set on the teacher's tokens (what the KD step wrote before; main's training then indexed the
    student's logits with the teacher's ids) is refused by training, naming the file, line and field."""
    from distillgates.teacher.kd import KDSetError, build_kd_set
    from distillgates.train.data import read_kd_set as read_for_training

    from .conftest import ReplayTeacher, kd_config

    en = [it for it in toy_items if it["locale"] == "en"]
    path = tmp_path / "kd.jsonl"
    build_kd_set(kd_config(), ReplayTeacher(en, other_tokenizer), en, path, progress=False)
    assert len(read_for_training(path, other_tokenizer)) == len(en)
    with pytest.raises(KDSetError, match=r"kd.jsonl:1: tokenizer_fingerprint: the KD set is on tokenizer "
                                         rf"{tokenizer_fingerprint(other_tokenizer)[:16]}, the student's is "
                                         rf"{tokenizer_fingerprint(tiny_tokenizer)[:16]}"):  # fmt: skip
        read_for_training(path, tiny_tokenizer)


def test_online_kd_refuses_a_teacher_with_another_tokenizer(tiny_tokenizer, other_tokenizer, toy_items, tmp_path):
    """Online KD compares dense logits id by id: a local teacher with another vocabulary is refused up front."""
    from distillgates.teacher.local import LocalTeacher
    from distillgates.train.recipe import train_student

    from ..train.conftest import tiny_config

    teacher = LocalTeacher(save_tiny_teacher(tmp_path / "teacher", other_tokenizer))
    cfg = tiny_config(len(tiny_tokenizer), steps=2, warmup_steps=1, teacher_mode="online")
    with pytest.raises(ValueError, match=r"train.teacher_mode 'online' .*: the run's tokenizer \(\d+ tokens\) does "
                                         rf"not match the checkpoint's \({len(other_tokenizer)} tokens\)"):  # fmt: skip
        train_student(cfg, "student", tmp_path / "out", teacher=teacher, tokenizer=tiny_tokenizer,
                      train_items=toy_items, eval_items=toy_items[:1], progress=False, device="cpu")
