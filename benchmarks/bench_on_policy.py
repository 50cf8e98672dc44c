"""Off-policy KD, on-policy KD and TRL's ``DistillationTrainer``, side by side on equal wall time (issue #43).

``RUN_DIR`` holds a pipeline build of ``CONFIG`` up to its KD set (``distillgates data/teacher/check/kd``): the
data, the trained teacher and the KD set every arm shares. Arms (each in its own process, so its peak RSS is its
own; ``--threads`` torch threads each):

- ``off``: the config's student recipe as it is (off-policy: CE on the references + top-k KD on the teacher's
  own tokens + the latency losses, late QAT). Its wall time is the budget ``B`` of the other arms.
- ``on<share>b<beta>[s<start>]`` (percent; e.g. ``on25b50``, ``on50b50s50``): the same recipe with
  ``train.on_policy`` {share, beta, start_fraction}: that share of the steps (from ``start`` of them on: an
  off-policy phase first) trains on the student's own sampled conversations (tools answered by the fixtures),
  scored by the local teacher.
- ``teacher``: no training: the run's teacher scored by the same eval (the figure a student is held to).
- ``trl``: TRL's ``DistillationTrainer`` (on-policy on every step, generalized JSD ``--trl-beta``), from the same
  student initialisation (the recipe's ``init_from: teacher`` layers), the same teacher, the training items'
  prompts (the eval's rendering, each item's tools in its system prompt), the recipe's batch, peak LR, warmup and
  cosine floor, ``max_completion_length`` the recipe's ``length.max_new_tokens``. TRL plays one assistant turn
  per prompt (its tool loop runs Python callables; the fixtures answer per item), and has no CE, latency losses
  or QAT.

Every arm gets the budget's wall time, schedule included, priced from measured step times: an off-policy step
and the start-up and finish from the off arm's log (``train_log.jsonl``'s ``step_s``: its whole run, every shape of
the schedule, QAT included; the start-up is its wall time less its steps); an on-policy step from ``--calib-steps``
steps sampled by the off arm's trained student (a trained student calls tools, and its conversations, with their
tool results and turns, are longer and dearer to sample than an untrained one's: priced on an untrained student,
the on-policy arm of 14.1 overran its budget by 43%). An on-policy arm then trains the most steps whose predicted
time fits the budget, each step costed by its kind (the recipe's own on-policy draw). The TRL arm (every step
samples) times ``--calib-steps`` steps of its own (start-up: that run's wall time less its steps). Every student
is scored by the project's eval (:func:`distillgates.eval.evaluate.evaluate`, PyTorch engine, greedy) on the whole
eval split: F1 lax and tool selection with their 95% intervals, median tokens out, TTFA p50 (tokens).
``--eval-only`` trains nothing: it scores the arms' students already in ``--work`` again, with the config's eval
settings as they are now (e.g. after ``eval.max_new_tokens`` changed).

Usage (from the repository root)::

    for s in data teacher check kd; do distillgates $s examples/own-data/config.yaml --run-dir /tmp/own; done
    .venv/bin/python benchmarks/bench_on_policy.py /tmp/own examples/own-data/config.yaml \\
        --arms off,on25b50,on50b50,trl --out benchmarks/results/on_policy_own_data.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distillgates.config import Config, load_config
from distillgates.pipeline import machine_identity
from distillgates.rundir import RunDir


def arm_config(cfg: Config, arm: str, steps: int | None = None) -> Config:
    if steps is not None:  # a shorter budget than the config's: every arm's schedule fits it
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    if arm in ("off", "trl", "teacher"):
        return cfg
    match = re.fullmatch(r"on(\d+)b(\d+)(?:s(\d+))?", arm)
    if match is None:
        raise SystemExit(f"unknown arm {arm!r}: off, teacher, trl or on<share>b<beta>[s<start>] (percent)")
    share, beta, start = (int(x or 0) / 100 for x in match.groups())
    on_policy = dataclasses.replace(cfg.train.on_policy, share=share, beta=beta, start_fraction=start,
                                    max_new_tokens=cfg.train.length.max_new_tokens, max_turns=cfg.eval.max_calls)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_policy=on_policy))


def work_dir(src: RunDir, path: Path) -> RunDir:
    """A run dir for one arm: the shared data, teacher and KD set linked in, its own student."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name in ("data", "teacher", "kd"):
        (path / name).symlink_to((src.root / name).resolve())
    return RunDir(path)


def train_ours(cfg: Config, run: RunDir, steps: int | None, max_steps: int | None = None) -> float:
    from distillgates.pipeline import scoring_teacher
    from distillgates.train.recipe import train_student

    if steps is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    start = time.perf_counter()
    train_student(cfg, "student", run, teacher=scoring_teacher(cfg, run, "student"), progress=False, device="cpu",
                  max_steps=max_steps)
    return time.perf_counter() - start


def student_init(cfg: Config, run: RunDir) -> Path:
    """The recipe's initial student (``init_from: teacher``: the same layers) in Hugging Face format, in the arm's
    run dir (whose student is never trained by the recipe: TRL's arm)."""
    from distillgates.hf import save_hf
    from distillgates.train.recipe import build_recipe

    recipe = build_recipe(cfg, "student", run, device="cpu", progress=False)
    recipe.setup()
    return save_hf(recipe.model, run.root / "init_hf", recipe.tokenizer)


def train_trl(cfg: Config, run: RunDir, steps: int, beta: float) -> tuple[float, list[float]]:
    """TRL's trainer for ``steps`` steps from the recipe's initial student: the wall seconds, and each step's (from
    the end of the one before; the first from the start of training)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from distillgates.data.chat import chat_format
    from distillgates.eval.runners import eval_prompt_item
    from distillgates.hf import from_hf
    from distillgates.model import save_model

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.last = 0.0

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    tok = run.tokenizer()
    fmt = chat_format(tok)
    start = time.perf_counter()
    student = AutoModelForCausalLM.from_pretrained(student_init(cfg, run), dtype=torch.float32)
    student.generation_config.eos_token_id = list(fmt.stop_ids)  # a turn ends on the format's stop ids
    teacher = AutoModelForCausalLM.from_pretrained(run.teacher_model_dir(cfg), dtype=torch.float32)
    prompts = [fmt.prompt(eval_prompt_item(item)) for item in run.items("train")]
    t = cfg.train
    args = DistillationConfig(
        output_dir=str(run.root / "trl"), max_steps=steps, per_device_train_batch_size=t.batch_size,
        learning_rate=t.lr, warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio}, weight_decay=t.weight_decay, max_grad_norm=t.clip_grad,
        max_completion_length=t.length.max_new_tokens, temperature=1.0, beta=beta, use_cpu=True, bf16=False,
        gradient_checkpointing=False, report_to="none", logging_steps=10, save_strategy="no", seed=t.seed,
    )  # fmt: skip
    clock = StepClock()
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[clock])  # fmt: skip
    trainer.train()
    run.model_dir("student").mkdir(parents=True, exist_ok=True)
    trained = from_hf(student.eval(), cfg.student.max_seq_len)  # the trainer trains the model in place
    save_model(run.model_dir("student") / "model.pt", trained)
    return time.perf_counter() - start, clock.seconds


def evaluate_student(cfg: Config, run: RunDir, engine: Any = None) -> dict[str, Any]:
    """The eval step's figures of the arm's student (or of ``engine``: the teacher's runner) on every eval item."""
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.scorer import item_f1
    from distillgates.gates.stats import mean_interval, wilson_interval
    from distillgates.runtime.torch_engine import TorchEngine

    items = run.items("eval")
    quality, _, scores = evaluate(
        engine or TorchEngine(run.load_model()), items, run.tokenizer(), lengths=cfg.shapes.lengths,
        max_calls=cfg.eval.max_calls, max_new_tokens=cfg.eval.max_new_tokens, return_outputs=True, progress=False,
        policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result), privacy=cfg.eval.privacy,
    )  # fmt: skip
    f1 = mean_interval([item_f1(s, strict=False) for s in scores if s.eligible])
    sel = wilson_interval(sum(s.selection_ok for s in scores), len(scores))
    keys = ("n", "f1_lax_macro", "tool_selection", "json_validity", "fixture_hit_rate", "median_tokens_out",
            "ttfa_tokens_p50")  # fmt: skip
    return {**{k: quality.get(k) for k in keys},
            "f1_lax_ci": [round(f1.low, 4), round(f1.high, 4)] if f1 else None,
            "tool_selection_ci": [round(sel.low, 4), round(sel.high, 4)] if sel else None}  # fmt: skip


def step_log(run: RunDir) -> list[dict[str, Any]]:
    """The training steps of a run's student (``train_log.jsonl``: each with its wall seconds ``step_s``)."""
    path = run.model_dir("student") / "train_log.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no training log (run the off arm first in --work: its log prices off-policy steps)")
    return [r for r in map(json.loads, path.read_text().splitlines()) if "step_s" in r]


def _mean(xs: list[float], what: str) -> float:
    if not xs:
        raise SystemExit(f"calibration: no {what} step timed (raise --calib-steps)")
    return statistics.fmean(xs)


def step_times(budget: float, off: list[dict[str, Any]], calib: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds of a step of each kind (means: a step's time depends on its shape, and the budget is a sum): an
    off-policy step from the off arm's whole run (the same data, model and shape schedule, its QAT steps included),
    and its start-up and finish (its wall time, the budget, less its steps); an on-policy step from the calibration
    run (the off arm's trained student sampling: its conversations are as long as a trained student's)."""
    t_off = _mean([r["step_s"] for r in off], "off-policy")
    t_on = _mean([r["step_s"] for r in calib if r["on_policy"]], "on-policy")
    startup = max(budget - sum(r["step_s"] for r in off), 0.0)
    return {"off_step_s": round(t_off, 3), "on_step_s": round(t_on, 3), "startup_s": round(startup, 1)}


def steps_for_budget(cfg: Config, budget: float, timing: dict[str, float]) -> int:
    """The most steps whose predicted wall time fits ``budget``: the start-up plus each step's mean cost by its kind
    (on-policy or not: :func:`~distillgates.train.on_policy.on_policy_step`, the recipe's own draw)."""
    from distillgates.train.on_policy import on_policy_step

    def predicted(n: int) -> float:
        t = dataclasses.replace(cfg.train, steps=n)  # the off-policy phase scales with the steps
        on = sum(on_policy_step(t, s) for s in range(n))
        return timing["startup_s"] + on * timing["on_step_s"] + (n - on) * timing["off_step_s"]

    n = cfg.train.warmup_steps + 1
    while predicted(n + 1) <= budget:
        n += 1
    return n


def run_arm(args: argparse.Namespace) -> None:
    """One arm in this process: calibrate (unless ``off``), train to the budget, evaluate; JSON on stdout."""
    torch.set_num_threads(args.threads)
    cfg = arm_config(load_config(args.config), args.arm, args.off_steps)
    src = RunDir(args.run_dir)
    result: dict[str, Any] = {"arm": args.arm}
    if args.arm == "teacher":  # the reference the students are held to: the run's teacher, no training
        from distillgates.teacher.check import teacher_runner

        return _report({**result, **evaluate_student(cfg, src, teacher_runner(cfg, src, src.tokenizer()))})
    if args.eval_only:  # the arm's student as trained before in --work, scored again (e.g. after an eval change)
        run = RunDir(args.work / args.arm)
        if not run.model_path().is_file():
            raise SystemExit(f"--eval-only: no student of arm {args.arm} in {run.root} (train it first)")
        return _report({**result, "eval_only": True, **evaluate_student(cfg, run)})
    steps = None
    if args.arm == "trl":  # start-up and mean step from one short run (every TRL step samples)
        wall, step_s = train_trl(cfg, work_dir(src, args.work / "trl-calib"), args.calib_steps, args.trl_beta)
        per_step = _mean(step_s, "TRL")
        startup = max(wall - sum(step_s), 0.0)
        steps = max(cfg.train.warmup_steps + 1, int((args.budget - startup) / per_step))
        result.update(calib={"on_step_s": round(per_step, 3), "startup_s": round(startup, 1)})
    elif args.arm != "off":  # the recipe's own step times, by kind: the off arm's log and a short on-policy run
        off = RunDir(args.work / "off")
        calib_train = dataclasses.replace(cfg.train, init_from=f"hf:{off.hf_model_dir('student')}",
                                          on_policy=dataclasses.replace(cfg.train.on_policy, share=1.0,
                                                                        start_fraction=0.0))  # fmt: skip
        calib = work_dir(src, args.work / f"{args.arm}-calib")
        train_ours(dataclasses.replace(cfg, train=calib_train), calib, None, max_steps=args.calib_steps)
        timing = step_times(args.budget, step_log(off), step_log(calib))
        steps = steps_for_budget(cfg, args.budget, timing)
        result.update(calib=timing)
    run = work_dir(src, args.work / args.arm)
    seconds = train_trl(cfg, run, steps or 0, args.trl_beta)[0] if args.arm == "trl" else train_ours(cfg, run, steps)
    result.update(steps=steps or cfg.train.steps, train_seconds=round(seconds, 1))
    _report({**result, **evaluate_student(cfg, run)})


def _report(result: dict[str, Any]) -> None:
    """The arm's result line on stdout (the driver reads it), with this process's peak RSS."""
    from distillgates.hardware import peak_rss_bytes

    result["peak_rss_mb"] = round(peak_rss_bytes() / 2**20)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("config", type=Path)
    parser.add_argument("--arms", default="off,on25b50,on50b50,trl")
    parser.add_argument("--calib-steps", type=int, default=20)
    parser.add_argument("--trl-beta", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_on_policy"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--off-steps", type=int, default=None,
                        help="the off arm's steps (default: the config's train.steps); its wall time is the budget")
    parser.add_argument("--eval-only", action="store_true",
                        help="score the arms' students trained before in --work again (the config's eval settings)")
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child process: one arm
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds: the off arm's train_seconds, when it ran before in --work (its log stays there)")
    args = parser.parse_args()
    if args.arm:
        return run_arm(args)
    results, budget = [], args.budget
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, str(args.run_dir), str(args.config), "--arm", arm, "--budget", str(budget),
               "--calib-steps", str(args.calib_steps), "--trl-beta", str(args.trl_beta), "--threads",
               str(args.threads), "--work", str(args.work)]  # fmt: skip
        cmd += ["--off-steps", str(args.off_steps)] if args.off_steps else []
        cmd += ["--eval-only"] if args.eval_only else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"arm {arm} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result = json.loads(line.removeprefix("RESULT "))
        budget = budget or result.get("train_seconds", 0.0)
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {"config": str(args.config), "off_steps": args.off_steps, "budget_seconds": budget,
              "eval_only": args.eval_only, "eval_max_new_tokens": load_config(args.config).eval.max_new_tokens,
              "threads": args.threads,
              "machine": machine_identity(),
              "torch": torch.__version__, "arms": results}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

