"""Off-policy KD, on-policy KD and TRL's ``DistillationTrainer``, side by side on equal wall time (issue #43).

``RUN_DIR`` holds a pipeline build of ``CONFIG`` up to its KD set (``distillgates data/teacher/check/kd``): the
data, the trained teacher and the KD set every arm shares. Arms (each in its own process, so its peak RSS is its
own; ``--threads`` torch threads each):

- ``off``: the config's student recipe as it is (off-policy: CE on the references + top-k KD on the teacher's
  own tokens + the latency losses, late QAT). Its wall time is the budget ``B`` of the other arms.
- ``on<share>b<beta>`` (e.g. ``on25b50``): the same recipe with ``train.on_policy`` {share, beta}: that share of
  the steps trains on the student's own sampled conversations (tools answered by the fixtures), scored by the
  local teacher.
- ``trl``: TRL's ``DistillationTrainer`` (on-policy on every step, generalized JSD ``--trl-beta``), from the same
  student initialisation (the recipe's ``init_from: teacher`` layers), the same teacher, the training items'
  prompts (the eval's rendering, each item's tools in its system prompt), the recipe's batch, peak LR, warmup and
  cosine floor, ``max_completion_length`` the recipe's ``length.max_new_tokens``. TRL plays one assistant turn
  per prompt (its tool loop runs Python callables; the fixtures answer per item), and has no CE, latency losses
  or QAT.

The on-policy and TRL arms first time runs of ``--calib-steps`` and twice as many steps (their start-up and
seconds per step), then train ``(B - start-up) / (seconds per step)`` steps, so every arm gets the same wall
time, schedule included. Every student is
scored by the project's eval (:func:`distillgates.eval.evaluate.evaluate`, PyTorch engine, greedy) on the whole
eval split: F1 lax and tool selection with their 95% intervals, median tokens out, TTFA p50 (tokens).

Usage (from the repository root)::

    for s in data teacher check kd; do distillgates $s examples/own-data/config.yaml --run-dir /tmp/own; done
    .venv/bin/python benchmarks/bench_on_policy.py /tmp/own examples/own-data/config.yaml \\
        --arms off,on25b50,on50b50,trl --out benchmarks/results/on_policy_own_data.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distillgates.config import Config, load_config
from distillgates.rundir import RunDir


def arm_config(cfg: Config, arm: str, steps: int | None = None) -> Config:
    if steps is not None:  # a shorter budget than the config's: every arm's schedule fits it
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    if arm in ("off", "trl"):
        return cfg
    share, beta = (int(x) / 100 for x in arm.removeprefix("on").split("b"))
    on_policy = dataclasses.replace(cfg.train.on_policy, share=share, beta=beta,
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
    from distillgates.teacher.local import LocalTeacher
    from distillgates.train.recipe import train_student

    if steps is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    teacher = LocalTeacher(run.teacher_model_dir(cfg)) if cfg.train.on_policy.share > 0 else None
    start = time.perf_counter()
    train_student(cfg, "student", run, teacher=teacher, progress=False, device="cpu", max_steps=max_steps)
    return time.perf_counter() - start


def student_init(cfg: Config, run: RunDir, out: Path) -> Path:
    """The recipe's initial student (``init_from: teacher``: the same layers) in Hugging Face format."""
    from distillgates.hf import save_hf
    from distillgates.train.data import read_kd_set
    from distillgates.train.recipe import Recipe, _init_teacher

    tok = run.tokenizer()
    recipe = Recipe(cfg.train, cfg.student, cfg.shapes, tok, run.items("train"), [], out / "init",
                    kd_records=read_kd_set(run.kd_set, tok), device="cpu", progress=False,
                    init_teacher=_init_teacher(cfg, run, tok))  # fmt: skip
    recipe.setup()
    return save_hf(recipe.model, out / "init_hf", tok)


def train_trl(cfg: Config, run: RunDir, steps: int, beta: float) -> float:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    from distillgates.data.chat import chat_format
    from distillgates.eval.runners import eval_prompt_item
    from distillgates.hf import from_hf
    from distillgates.model import save_model

    tok = run.tokenizer()
    fmt = chat_format(tok)
    start = time.perf_counter()
    student = AutoModelForCausalLM.from_pretrained(student_init(cfg, run, run.root), dtype=torch.float32)
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
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}))  # fmt: skip
    trainer.train()
    seconds = time.perf_counter() - start
    run.model_dir("student").mkdir(parents=True, exist_ok=True)
    save_model(run.model_dir("student") / "model.pt", from_hf(trainer.model.eval(), cfg.student.max_seq_len))
    return seconds


def evaluate_student(cfg: Config, run: RunDir) -> dict[str, Any]:
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.scorer import item_f1
    from distillgates.gates.stats import mean_interval, wilson_interval
    from distillgates.runtime.torch_engine import TorchEngine

    items = run.items("eval")
    quality, _, scores = evaluate(
        TorchEngine(run.load_model()), items, run.tokenizer(), lengths=cfg.shapes.lengths, max_calls=cfg.eval.max_calls,
        max_new_tokens=cfg.eval.max_new_tokens, return_outputs=True, progress=False,
        policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result), privacy=cfg.eval.privacy,
    )  # fmt: skip
    f1 = mean_interval([item_f1(s, strict=False) for s in scores if s.eligible])
    sel = wilson_interval(sum(s.selection_ok for s in scores), len(scores))
    keys = ("n", "f1_lax_macro", "tool_selection", "json_validity", "fixture_hit_rate", "median_tokens_out",
            "ttfa_tokens_p50")  # fmt: skip
    return {**{k: quality.get(k) for k in keys},
            "f1_lax_ci": [round(f1.low, 4), round(f1.high, 4)] if f1 else None,
            "tool_selection_ci": [round(sel.low, 4), round(sel.high, 4)] if sel else None}  # fmt: skip


def run_arm(args: argparse.Namespace) -> None:
    """One arm in this process: calibrate (unless ``off``), train to the budget, evaluate; JSON on stdout."""
    torch.set_num_threads(args.threads)
    cfg = arm_config(load_config(args.config), args.arm, args.off_steps)
    src = RunDir(args.run_dir)
    result: dict[str, Any] = {"arm": args.arm}
    steps = None
    if args.arm != "off":  # start-up and seconds per step from two short runs of the same schedule
        def timed(n: int) -> float:
            calib = work_dir(src, args.work / f"{args.arm}-calib{n}")
            if args.arm == "trl":
                return train_trl(cfg, calib, n, args.trl_beta)
            return train_ours(cfg, calib, None, max_steps=n)

        short, long = timed(args.calib_steps), timed(2 * args.calib_steps)
        per_step = (long - short) / args.calib_steps if long > short else long / (2 * args.calib_steps)
        startup = max(short - args.calib_steps * per_step, 0.0)
        steps = max(cfg.train.warmup_steps + 1, round((args.budget - startup) / per_step))
        result.update(calib_seconds_per_step=round(per_step, 3), calib_startup_seconds=round(startup, 1))
    run = work_dir(src, args.work / args.arm)
    seconds = train_trl(cfg, run, steps or 0, args.trl_beta) if args.arm == "trl" else train_ours(cfg, run, steps)
    result.update(steps=steps or cfg.train.steps, train_seconds=round(seconds, 1))
    result.update(evaluate_student(cfg, run))
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
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
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a child process: one arm
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return run_arm(args)
    results, budget = [], 0.0
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, str(args.run_dir), str(args.config), "--arm", arm, "--budget", str(budget),
               "--calib-steps", str(args.calib_steps), "--trl-beta", str(args.trl_beta), "--threads",
               str(args.threads), "--work", str(args.work)]  # fmt: skip
        cmd += ["--off-steps", str(args.off_steps)] if args.off_steps else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"arm {arm} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        result = json.loads(line.removeprefix("RESULT "))
        budget = budget or result["train_seconds"]
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {"config": str(args.config), "off_steps": args.off_steps, "budget_seconds": budget,
              "threads": args.threads,
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available",
              "torch": torch.__version__, "arms": results}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

