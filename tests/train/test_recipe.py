"""The training recipe on tiny real toy data: learning, QAT, resume after SIGKILL, torchrun DDP."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.io import load_checksummed
from distillgates.model import Transformer, load_model
from distillgates.teacher.kd import KDSetError
from distillgates.train.data import read_kd_set
from distillgates.train.recipe import Recipe, train_student

from ..conftest import largest_tensor

REPO = Path(__file__).parents[2]
RUN_TINY = ["-m", "tests.train.run_tiny"]  # a module run from REPO: it imports the test conftests


def _recipe(art: dict[str, Any], out: Path, **train: Any) -> Recipe:
    cfg = art["make_config"](len(art["tokenizer"]), **train)
    return Recipe(
        cfg.train, cfg.student, cfg.shapes, art["tokenizer"], art["train"], art["eval"], out,
        kd_records=read_kd_set(art["kd_path"]), device="cpu", progress=False, speed_prompts=0,
    )


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_training_lowers_validation_loss(artifacts: dict[str, Any], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    recipe = _recipe(artifacts, tmp_path, steps=12, lr=1e-2)
    recipe.setup()
    before = recipe.validate()["val"]["ce_by_shape"]
    recipe.train()
    after = recipe.validate()["val"]["ce_by_shape"]
    for shape in before:
        assert after[shape] < before[shape] - 0.3, (before, after)
    steps = [r for r in _log(tmp_path / "train_log.jsonl") if "total" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["kd"] > 0 and r["ce"] > 0 and r["step_s"] > 0 for r in steps)  # each step's wall seconds
    assert any(r["early_tool"] > 0 for r in steps) and steps[0]["early_tool_weight"] == 0.0


def test_items_without_a_kd_record_train_on_their_references(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """A KD set over part of the data (``kd.items``): the other rows get no KD targets and
    their reference length, and training runs on all rows."""
    torch.set_num_threads(1)
    records = read_kd_set(artifacts["kd_path"])
    half = dict(list(records.items())[: len(records) // 2])
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=4, lr=1e-2)
    recipe = Recipe(
        cfg.train, cfg.student, cfg.shapes, artifacts["tokenizer"], artifacts["train"], artifacts["eval"], tmp_path,
        kd_records=half, device="cpu", progress=False, speed_prompts=0,
    )
    recipe.setup()
    covered = [row.item["id"] in half for row in recipe.rows]
    assert any(covered) and not all(covered)
    assert all(bool(row.kd_ids) == cov and row.teacher_len > 0 for row, cov in zip(recipe.rows, covered))
    recipe.train()
    steps = [r for r in _log(tmp_path / "train_log.jsonl") if "total" in r]
    assert len(steps) == 4 and all(r["ce"] > 0 for r in steps)


def test_a_text_only_kd_set_trains_on_the_teachers_text(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """A KD set without log-probs (header ``logprobs: false``): rows are the teacher's completions
    (sequence-level KD), no top-k term, and training runs on them."""
    torch.set_num_threads(1)
    lines = artifacts["kd_path"].read_text(encoding="utf-8").splitlines()
    text_only = tmp_path / "kd.jsonl"
    text_only.write_text("\n".join([json.dumps({**json.loads(lines[0]), "logprobs": False}), *lines[1:]]) + "\n")
    records = read_kd_set(text_only)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, lr=1e-2)
    recipe = Recipe(
        cfg.train, cfg.student, cfg.shapes, artifacts["tokenizer"], artifacts["train"], artifacts["eval"],
        tmp_path / "out", kd_records=records, device="cpu", progress=False, speed_prompts=0,
    )  # fmt: skip
    recipe.setup()
    finished = [row for row in recipe.rows if records[row.item["id"]]["finish"] == "stop"]
    assert finished and all(not row.kd_ids for row in recipe.rows)
    for row in finished:
        completion = artifacts["tokenizer"].decode(row.ids[row.prompt_len :])
        assert records[row.item["id"]]["completion_text"].startswith(completion)  # the teacher's text (maybe cut)
    recipe.train()
    steps = [r for r in _log(tmp_path / "out" / "train_log.jsonl") if "total" in r]
    assert len(steps) == 3 and all(r["ce"] > 0 and r.get("kd", 0.0) == 0.0 for r in steps)


def test_early_tool_loss_makes_tool_call_first(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """With the early-tool loss, ``<|tool_call|>`` right after ``<|assistant|>`` gets likelier on
    verbose tool items (whose references start with a preamble) than with the same run without it."""
    torch.set_num_threads(1)
    from distillgates.data.chat import render_prompt

    tok = artifacts["tokenizer"]
    call_id = tok.convert_tokens_to_ids("<|tool_call|>")
    verbose = [i for i in artifacts["train"] if i["tool_should_be_used"] and not i["reference"].startswith("<|tool")]
    assert verbose, "toy data has verbose tool items"
    probs = {}
    for weight in (0.0, 1.0):
        recipe = _recipe(artifacts, tmp_path / str(weight), steps=12, lr=1e-2,
                         early_tool={"weight": weight, "ramp_epochs": 0.0, "first_n_tokens": 8})
        recipe.setup()
        recipe.train()
        model = recipe.model.eval()
        p = []
        for item in verbose:
            ids = torch.tensor([tok.encode(render_prompt(item), add_special_tokens=False)])
            p.append(float(model(ids)[0, -1].softmax(-1)[call_id]))
        probs[weight] = sum(p) / len(p)
    assert probs[1.0] > 2 * probs[0.0], probs


# "evidence" may only cut what follows the last evidence value, so it shortens less
@pytest.mark.parametrize(("target", "hinge", "max_ratio"), [("teacher", -0.5, 0.8), ("evidence", 0.0, 0.9)])
def test_length_loss_shortens_expected_length(
    artifacts: dict[str, Any], tmp_path: Path, target: str, hinge: float, max_ratio: float
) -> None:
    """The length term lowers the student's expected output length vs the same run without it."""
    torch.set_num_threads(1)
    lengths = {}
    for weight in (0.0, 2.0):
        recipe = _recipe(artifacts, tmp_path / str(weight), steps=10, lr=1e-2,
                         length={"weight": weight, "hinge": hinge, "exempt_when_covered": False, "target": target})
        recipe.setup()
        recipe.train()
        recipe.cfg.length.weight = 1.0  # measure the expected length the same way for both runs
        batch = recipe._micro_batches(0)[0]
        with torch.no_grad():
            _, parts = recipe.compute_loss(batch, epoch=1.0)
        lengths[weight] = parts["expected_len"]
    assert lengths[2.0] < max_ratio * lengths[0.0], lengths


def test_length_slope_scales_and_cap_bounds_the_penalty(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """``train.length.slope`` multiplies the penalty, ``cap`` bounds each row's: through the recipe's loss on one
    batch of an untrained student (which rambles: every row far over its target), a capped penalty equals the cap
    and adds no gradient (the step's gradient is the one without the length term)."""
    torch.set_num_threads(1)
    results = {}
    arms = {"off": {"weight": 0.0}, "slope1": {}, "slope3": {"slope": 3.0}, "capped": {"slope": 3.0, "cap": 1e-3}}
    for name, length in arms.items():
        torch.manual_seed(0)
        recipe = _recipe(artifacts, tmp_path / name, steps=4,
                         length={"weight": 1.0, "hinge": 0.0, "exempt_when_covered": False} | length)
        recipe.setup()
        batch = recipe._micro_batches(0)[0]
        total, parts = recipe.compute_loss(batch, epoch=1.0)
        total.backward()
        results[name] = (parts, recipe.model.layers[0].attn.q_proj.weight.grad.clone())
    assert results["slope1"][0]["length"] > 0.5  # rambling: the penalty is far over the cap
    assert results["slope3"][0]["length"] == pytest.approx(3 * results["slope1"][0]["length"], rel=1e-5)
    assert results["capped"][0]["length"] == pytest.approx(1e-3, rel=1e-5)
    assert not torch.allclose(results["slope1"][1], results["off"][1])
    torch.testing.assert_close(results["capped"][1], results["off"][1])


def test_qat_writes_probe_and_int8_grid_weights(artifacts: dict[str, Any], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=6, qat={"enabled": True, "start_fraction": 0.5,
                                                                  "lr_scale": 0.1, "ema": 0.5})
    path = train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                         train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")
    probe = json.loads((tmp_path / "student" / "qat_probe.json").read_text())
    assert probe["has_nan"] is False
    assert set(probe["probe_cosine"]) == {f"layers.{i}.{p}" for i in range(2) for p in ("attn", "mlp")}
    assert probe["probe_cosine_min"] > 0.99 and probe["quantization_only"]["probe_cosine_min"] > 0.999
    payload = load_checksummed(path)
    model = load_model(path)
    scales = payload["quantization"]["modules"]
    assert "layers.0.attn.q_proj" in scales and "lm_head" in scales
    for name, entry in scales.items():
        w = model.get_submodule(name).weight.detach()
        q = w / torch.tensor(entry["scale"])[:, None]
        assert torch.allclose(q, q.round(), atol=1e-3), name  # weights sit on the int8 grid
        assert q.abs().max() <= 128
    log = [r for r in _log(tmp_path / "student" / "train_log.jsonl") if "total" in r]
    assert [r["qat"] for r in log] == [False, False, False, True, True, True]
    assert log[3]["lr"] < 0.2 * log[2]["lr"]


def test_int4_qat_follows_export_quantize_to_the_int4_grid(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """``export.quantize: int4``: the student's late QAT trains the export's int4 per-block grid (block 16)."""
    import dataclasses

    from distillgates.config import ExportConfig
    from distillgates.export.grid import int4_block_grid

    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=4, qat={"enabled": True, "start_fraction": 0.5,
                                                                  "lr_scale": 0.1})
    cfg = dataclasses.replace(cfg, export=ExportConfig(quantize="int4", int4_block_size=16))
    path = train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                         train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")
    meta = load_checksummed(path)["quantization"]
    assert meta["scheme"] == "int4_per_block_symmetric" and meta["block_size"] == 16
    model = load_model(path)
    assert "layers.0.attn.q_proj" in meta["modules"] and "lm_head" in meta["modules"]
    for name in meta["modules"]:
        weight = model.get_submodule(name).weight.detach()
        codes, scale = int4_block_grid(weight, 16)
        assert torch.equal((codes * scale[..., None]).reshape(weight.shape), weight), name  # on the export's grid
    probe = json.loads((tmp_path / "student" / "qat_probe.json").read_text())
    assert probe["has_nan"] is False and probe["quantization_only"]["logits_cosine"] > 0.9


def test_int4_qat_resumes_bit_exact(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """A run stopped after step 6 (checkpoint of step 5, inside int4 QAT) and resumed ends where an uninterrupted
    run does: the int4 QAT state (EMA; the grid is a function of the weights) is all a checkpoint needs."""
    import dataclasses

    from distillgates.config import ExportConfig

    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=8, ckpt_every=5,
                                   qat={"enabled": True, "start_fraction": 0.5, "ema": 0.5})  # fmt: skip
    cfg = dataclasses.replace(cfg, export=ExportConfig(quantize="int4", int4_block_size=16))
    kw = dict(kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"], train_items=artifacts["train"],
              eval_items=artifacts["eval"], progress=False, device="cpu")  # fmt: skip
    full_path = train_student(cfg, "student", tmp_path / "full", **kw)
    assert load_checksummed(full_path)["quantization"]["scheme"] == "int4_per_block_symmetric"
    full = load_model(full_path)
    train_student(cfg, "student", tmp_path / "cut", max_steps=6, **kw)
    assert load_checksummed(tmp_path / "cut" / "student" / "checkpoint.pt")["step"] == 5
    resumed = load_model(train_student(cfg, "student", tmp_path / "cut", **kw))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("qat", [False, True], ids=["no-qat", "qat"])
def test_ema_decay_gives_the_model_the_average_of_the_steps_before_qat(
    artifacts: dict[str, Any], tmp_path: Path, qat: bool
) -> None:
    """``train.ema_decay``: the weights QAT starts from (or, without QAT, the saved ones) are the exponential moving
    average of the weights after each step before QAT, checked against the trajectory the optimizer produced."""
    torch.set_num_threads(1)
    qat_cfg = {"enabled": qat, "start_fraction": 0.5, "lr_scale": 0.1}
    recipe = _recipe(artifacts, tmp_path, steps=6, lr=1e-2, warmup_steps=1, ema_decay=0.5, qat=qat_cfg)
    recipe.setup()
    seen: list[dict[str, torch.Tensor]] = []
    step = recipe.optimizer.step

    def record(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        seen.append({n: p.detach().clone() for n, p in recipe.model.named_parameters()})
        return out

    recipe.optimizer.step = record  # type: ignore[method-assign]
    recipe.train()
    averaged = seen[:3] if qat else seen  # QAT starts at step 3 of 6
    expected = dict(averaged[0])
    for weights in averaged[1:]:
        expected = {n: 0.5 * expected[n] + 0.5 * w for n, w in weights.items()}
    model = recipe.qat_reference if qat else load_model(recipe.cleanup())
    assert model is not None
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=0, atol=1e-6)
    assert not torch.equal(expected["norm.weight"], seen[len(averaged) - 1]["norm.weight"])  # not the last step's


def test_ema_resumes_bit_exact(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """A run stopped with the moving average in its checkpoint (step 3, before QAT at 4) and resumed ends where an
    uninterrupted run does."""
    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=8, ckpt_every=3, ema_decay=0.7,
                                   qat={"enabled": True, "start_fraction": 0.5})  # fmt: skip
    kw = dict(kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"], train_items=artifacts["train"],
              eval_items=artifacts["eval"], progress=False, device="cpu")  # fmt: skip
    full = load_model(train_student(cfg, "student", tmp_path / "full", **kw))
    train_student(cfg, "student", tmp_path / "cut", max_steps=4, **kw)
    assert load_checksummed(tmp_path / "cut" / "student" / "checkpoint.pt")["ema"] is not None
    resumed = load_model(train_student(cfg, "student", tmp_path / "cut", **kw))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_online_teacher_and_bf16_autocast(artifacts: dict[str, Any], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, teacher_mode="online", mixed_precision="bf16")
    torch.manual_seed(123)  # a teacher that differs from the student's seed-0 init, so KD is not 0
    teacher = Transformer(cfg.student).eval()
    path = train_student(cfg, "student", tmp_path, teacher=teacher, tokenizer=artifacts["tokenizer"],
                         train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")
    assert isinstance(load_model(path), Transformer)
    log = [r for r in _log(tmp_path / "student" / "train_log.jsonl") if "total" in r]
    assert len(log) == 3 and all(r["kd"] > 0 for r in log)


@pytest.mark.parametrize("kind", ["transformer", "hf"])
def test_the_chunked_step_applies_an_online_teachers_head_a_chunk_at_a_time(artifacts: dict[str, Any],
                                                                            tmp_path: Path, kind: str) -> None:
    """Online KD with ``train.loss_chunk``: the teacher (a Transformer, or an HF checkpoint through LocalTeacher)
    gives its final hidden states and head weight, so neither its ``(R, L, V)`` logits nor the student's exist (no
    op makes a tensor over the vocabulary of more than a few chunks' rows), with the unchunked step's loss and
    gradients."""
    from distillgates.hf import save_hf
    from distillgates.teacher.local import LocalTeacher

    torch.set_num_threads(1)
    tok = artifacts["tokenizer"]
    vocab = len(tok)
    cfg = artifacts["make_config"](vocab)
    torch.manual_seed(123)  # a teacher that differs from the student's seed-0 init, so KD is not 0
    teacher: Any = Transformer(cfg.student).eval()
    if kind == "hf":
        teacher = LocalTeacher(save_hf(teacher, tmp_path / "teacher", tok), tokenizer=tok)
    results = []
    for chunk in (0, 7):
        cfg = artifacts["make_config"](vocab, teacher_mode="online", loss_chunk=chunk)
        recipe = Recipe(cfg.train, cfg.student, cfg.shapes, tok, artifacts["train"], artifacts["eval"],
                        tmp_path / str(chunk), teacher=teacher, device="cpu", progress=False, speed_prompts=0)
        recipe.setup()
        batch = recipe._micro_batches(0)[0]
        parts: dict[str, float] = {}
        largest = largest_tensor(functools.partial(_loss_backward, recipe, batch, parts), last_dim=vocab)
        rows = batch.input_ids.numel()  # R * L
        if chunk:  # one chunk's logits, or a head weight (d, V)
            assert largest <= max(chunk, cfg.student.d_model) * vocab < rows * vocab, (largest, rows * vocab)
        else:
            assert largest >= rows * vocab, (largest, rows * vocab)
        results.append((parts, recipe.model.get_parameter("embed.weight").grad.clone()))
    (plain, plain_grad), (chunked, chunked_grad) = results
    assert plain["kd"] > 0 and set(plain) == set(chunked)
    for name, value in plain.items():
        assert chunked[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    torch.testing.assert_close(chunked_grad, plain_grad, atol=1e-6, rtol=1e-4)


def _loss_backward(recipe: Recipe, batch: Any, parts: dict[str, float]) -> None:
    total, logged = recipe.compute_loss(batch, epoch=1.0)
    total.backward()
    parts.update(logged)


def test_an_hf_teacher_whose_logits_are_not_hidden_times_head_gives_its_logits() -> None:
    """An HF model whose logits are transformed after its head (Gemma 2's softcapping): teacher_fn's split is refused
    and it gives the logits themselves; without the softcap it splits, and the product equals the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from distillgates.train.recipe import teacher_fn

    ids = torch.randint(0, 64, (2, 6))
    for cap in (None, 3.0):
        torch.manual_seed(0)
        config = Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=cap)
        model = Gemma2ForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(50.0)  # logits past the cap
            logits = model(input_ids=ids).logits
            out = teacher_fn(model, split_head=True)(ids)
        if cap is None:
            hidden, head = out
            torch.testing.assert_close(hidden @ head.T, logits, atol=1e-4, rtol=1e-4)
        else:
            assert isinstance(out, torch.Tensor)
            torch.testing.assert_close(out, logits)


def test_bad_kd_record_names_file_line_field(artifacts: dict[str, Any], tmp_path: Path) -> None:
    lines = artifacts["kd_path"].read_text().splitlines()
    record = json.loads(lines[2])
    record["topk_ids"] = record["topk_ids"][:-1]
    path = tmp_path / "kd.jsonl"
    path.write_text("\n".join([lines[0], lines[1], json.dumps(record), *lines[3:]]) + "\n")
    with pytest.raises(KDSetError, match=r"kd.jsonl:3: topk_ids"):
        read_kd_set(path)



def _header(fn: Any) -> Any:
    return lambda lines: [json.dumps(fn(json.loads(lines[0]))), *lines[1:]]


def _record(n: int, fn: Any) -> Any:
    return lambda lines: [*lines[: n - 1], fn(json.loads(lines[n - 1])), *lines[n:]]


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda lines: [], "kd.jsonl:1: __header__"),
        (_header(lambda h: {k: v for k, v in h.items() if k != "top_k"}), "kd.jsonl:1: top_k"),
        (_header(lambda h: {**h, "kd_version": 0}), "kd.jsonl:1: kd_version"),
        (lambda lines: lines[:-1], "total"),
        (_record(3, lambda r: "[1, 2]"), "kd.jsonl:3: <line>"),
        (_record(3, lambda r: json.dumps({**r, "completion_text": 5})), "kd.jsonl:3: completion_text"),
        (_record(3, lambda r: json.dumps({**r, "completion_ids": ["a"] * len(r["completion_ids"])})),
         "kd.jsonl:3: completion_ids"),
    ],
)
def test_a_bad_kd_set_names_file_line_field(artifacts: dict[str, Any], tmp_path: Path, edit: Any, where: str) -> None:
    path = tmp_path / "kd.jsonl"
    path.write_text("".join(f"{line}\n" for line in edit(artifacts["kd_path"].read_text().splitlines())))
    with pytest.raises(KDSetError, match=re.escape(where)):
        read_kd_set(path)
    with pytest.raises(FileNotFoundError, match="KD set not found"):
        read_kd_set(tmp_path / "missing.jsonl")

def _run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False, **kw)


@pytest.mark.integration  # three training subprocesses, one killed (~10-20 s)
def test_resume_after_sigkill_is_bit_exact(artifacts: dict[str, Any], tmp_path: Path) -> None:
    overrides = json.dumps({"steps": 8, "ckpt_every": 3, "qat": {"enabled": True, "start_fraction": 0.5, "ema": 0.5}})
    root = str(artifacts["root"])
    full = _run([sys.executable, *RUN_TINY, root, str(tmp_path / "full"), overrides])
    assert full.returncode == 0, full.stderr[-3000:]
    # killed run: SIGKILL as soon as step 5 is done (checkpoint of step 3 exists, step 6 not yet)
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, *RUN_TINY, root, str(out), overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 5 "):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert load_checksummed(out / "student" / "checkpoint.pt")["step"] == 3
    assert not (out / "student" / "model.pt").exists()
    resumed = _run([sys.executable, *RUN_TINY, root, str(out), overrides])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.splitlines()[0].startswith("step 4 ")
    a = load_checksummed(tmp_path / "full" / "student" / "model.pt")["state_dict"]
    b = load_checksummed(out / "student" / "model.pt")["state_dict"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    full_log = [r for r in _log(tmp_path / "full" / "student" / "train_log.jsonl") if "total" in r]
    res_log = [r for r in _log(out / "student" / "train_log.jsonl") if "total" in r]
    assert [r["step"] for r in res_log] == list(range(1, 9))  # no gaps, no duplicates
    assert [r["total"] for r in res_log] == [r["total"] for r in full_log]


@pytest.mark.integration  # torchrun processes (~10-20 s each)
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
@pytest.mark.parametrize(("fsdp", "loss_chunk"), [(False, 0), (True, 0), (False, 5), (True, 5)],
                         ids=["ddp", "fsdp", "ddp-chunked-head", "fsdp-chunked-head"])
def test_torchrun_two_processes_match_one(artifacts: dict[str, Any], tmp_path: Path, fsdp: bool,
                                          loss_chunk: int) -> None:  # fmt: skip
    """2 ranks x 2 rows == 1 process with 2 accumulation steps of 2 rows (same global batch of 4),
    under DDP and under FSDP2 (``fully_shard``, gloo on CPU); with ``train.loss_chunk`` the LM head's weight leaves
    the wrapped forward (the loss applies it) and still gets its gradient reduced."""
    root = str(artifacts["root"])
    torchrun = str(Path(sys.executable).parent / "torchrun")
    one = _run([sys.executable, *RUN_TINY, root, str(tmp_path / "one"),
                json.dumps({"steps": 4, "grad_accum": 2, "loss_chunk": loss_chunk})])  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run([torchrun, "--standalone", "--nproc_per_node=2", *RUN_TINY, root, str(tmp_path / "two"),
                json.dumps({"steps": 4, "grad_accum": 1, "fsdp": fsdp, "ckpt_every": 2, "loss_chunk": loss_chunk})])
    assert two.returncode == 0, two.stderr[-3000:]
    l1 = [r["total"] for r in _log(tmp_path / "one" / "student" / "train_log.jsonl") if "total" in r]
    l2 = [r["total"] for r in _log(tmp_path / "two" / "student" / "train_log.jsonl") if "total" in r]
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=1e-5)
    m1 = load_model(tmp_path / "one" / "student" / "model.pt").state_dict()
    m2 = load_model(tmp_path / "two" / "student" / "model.pt").state_dict()
    for k in m1:
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-3, atol=1e-5)
    ckpt = load_checksummed(tmp_path / "two" / "student" / "checkpoint.pt")  # gathered, not rank 0's shards
    assert ckpt["step"] == 4 and all(ckpt["model"][k].shape == m1[k].shape for k in m1)


@pytest.mark.integration  # torchrun processes (~15-30 s)
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_fsdp_resume_continues_like_an_uninterrupted_run(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """FSDP checkpoints hold the full state; a 2-rank run stopped after step 2 and started again
    ends where an uninterrupted 2-rank run does."""
    root = str(artifacts["root"])
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", *RUN_TINY]
    cfg = {"steps": 4, "grad_accum": 1, "fsdp": True, "ckpt_every": 2}
    full = _run([*torchrun, root, str(tmp_path / "full"), json.dumps(cfg)])
    assert full.returncode == 0, full.stderr[-3000:]
    part = _run([*torchrun, root, str(tmp_path / "resumed"), json.dumps({**cfg, "max_steps": 2})])
    assert part.returncode == 0, part.stderr[-3000:]
    assert load_checksummed(tmp_path / "resumed" / "student" / "checkpoint.pt")["step"] == 2
    rest = _run([*torchrun, root, str(tmp_path / "resumed"), json.dumps(cfg)])
    assert rest.returncode == 0, rest.stderr[-3000:]
    a = load_model(tmp_path / "full" / "student" / "model.pt").state_dict()
    b = load_model(tmp_path / "resumed" / "student" / "model.pt").state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    steps = [r["step"] for r in _log(tmp_path / "resumed" / "student" / "train_log.jsonl") if "total" in r]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("qat", [False, True], ids=["float", "qat-int8"])
@pytest.mark.parametrize("exempt", [False, True], ids=["length", "length-exempt-when-covered"])
def test_chunked_losses_equal_the_unchunked_step(artifacts: dict[str, Any], tmp_path: Path, qat: bool,
                                                 exempt: bool) -> None:  # fmt: skip
    """``train.loss_chunk`` (the head applied chunk by chunk inside the losses): the same loss components and
    gradients as the whole-batch path (float tolerance), in float and under QAT, whose head weight is on the grid;
    the length penalty's exemption reads the same teacher-forced argmax. Validation's CE too."""
    torch.set_num_threads(1)
    results = []
    for chunk in (0, 7):
        recipe = _recipe(artifacts, tmp_path / str(chunk), steps=4, loss_chunk=chunk,
                         length={"weight": 0.5, "hinge": 0.0, "exempt_when_covered": exempt})  # fmt: skip
        recipe.setup()
        if qat:
            recipe._start_qat()
            recipe._wrap()
        batch = recipe._micro_batches(0)[0]
        total, parts = recipe.compute_loss(batch, epoch=1.0)
        total.backward()
        grads = {n: recipe.model.get_parameter(n).grad.clone() for n in ("layers.0.attn.q_proj.weight", "embed.weight")}
        results.append((parts, grads, recipe.validate()["val"]["ce_by_shape"]))
    (plain, plain_grads, plain_val), (chunked, chunked_grads, chunked_val) = results
    assert set(plain) == set(chunked) and {"ce", "process", "kd", "length", "early_tool"} <= set(plain)
    for name, value in plain.items():
        assert chunked[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for name, grad in plain_grads.items():  # embed.weight: the tied head's gradient too
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert chunked_val == pytest.approx(plain_val, rel=1e-5)


def test_the_chunked_step_applies_the_head_only_where_a_loss_reads(artifacts: dict[str, Any],
                                                                    tmp_path: Path) -> None:  # fmt: skip
    """The chunked step computes its per-position values at the assistant turns' positions and the early-tool
    loss's alone (each loss's mask lies in them): a row's prompt and its padding, most of a batch, get none."""
    torch.set_num_threads(1)
    recipe = _recipe(artifacts, tmp_path, steps=4, loss_chunk=7, length={"weight": 0.5, "hinge": 0.0})
    recipe.setup()
    batch = recipe._micro_batches(0)[0]
    hidden, head = recipe._forward(batch.input_ids)
    stats = recipe._position_stats(hidden, head, batch, batch.input_ids)
    read = batch.turn_mask | (batch.early_mask > 0)
    assert float(read.float().mean()) < 0.5 and set(stats) >= {"nll", "early_nll", "stop_prob", "kd"}
    for name in ("nll", "early_nll", "stop_prob"):
        assert bool((stats[name][~read] == 0).all()) and bool((stats[name][read] > 0).all()), name


def test_the_recipe_refuses_what_it_cannot_train(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """Each refusal names the setting: a missing KD set or teacher, an init it cannot build, a batch it cannot split,
    a KD set of other items, a checkpoint of another model, an unknown role."""
    tok, vocab = artifacts["tokenizer"], len(artifacts["tokenizer"])
    kd = read_kd_set(artifacts["kd_path"])

    def recipe(kd_records: Any = kd, **train: Any) -> Recipe:
        cfg = artifacts["make_config"](vocab, **train)
        return Recipe(cfg.train, cfg.student, cfg.shapes, tok, artifacts["train"], artifacts["eval"], tmp_path / "r",
                      kd_records=kd_records, device="cpu", progress=False, speed_prompts=0)  # fmt: skip

    with pytest.raises(ValueError, match="teacher_mode 'offline' needs a KD set"):
        recipe(kd_records=None)
    with pytest.raises(ValueError, match="teacher_mode 'online' needs a teacher"):
        recipe(teacher_mode="online")
    with pytest.raises(ValueError, match=r"train\.init_from 'teacher' needs the teacher model"):
        recipe(init_from="teacher")
    with pytest.raises(ValueError, match="needs the converted checkpoint as init_model"):
        recipe(init_from="hf:/nowhere")
    with pytest.raises(ValueError, match="no training item has a KD record"):
        recipe(kd_records={"other-item": next(iter(kd.values()))}).setup()
    with pytest.raises(ValueError, match=r"batch_size 4 must be divisible by world_size\*grad_accum = 3"):
        recipe(grad_accum=3).setup()
    trained = recipe(steps=3, ckpt_every=1)
    trained.setup()
    trained.train()
    cfg = artifacts["make_config"](vocab)
    wider = Recipe(cfg.train, dataclasses.replace(cfg.student, d_model=48, ffn_hidden=96), cfg.shapes, tok,
                   artifacts["train"], artifacts["eval"], tmp_path / "r", kd_records=kd, device="cpu", progress=False,
                   speed_prompts=0)  # fmt: skip
    with pytest.raises(ValueError, match="checkpoint was written for another model config"):
        wider.setup()
    with pytest.raises(ValueError, match="role must be 'student' or 'drafter', got 'teacher'"):
        train_student(cfg, "teacher", tmp_path)
    with pytest.raises(ValueError, match="config has no 'drafter' section"):
        train_student(cfg, "drafter", tmp_path, tokenizer=tok, train_items=[], eval_items=[])


def test_ema_decay_out_of_range_or_with_fsdp_is_refused() -> None:
    from distillgates.config import TrainConfig, from_dict

    with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\), got 1.5"):
        from_dict(TrainConfig, {"ema_decay": 1.5})
    with pytest.raises(ValueError, match=r"train\.ema_decay with train\.fsdp is not supported"):
        from_dict(TrainConfig, {"ema_decay": 0.99, "fsdp": True})
