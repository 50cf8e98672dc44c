"""The toy teacher's last-step weights against averages of the same trajectory, over seeds.

Where the toy teacher ends differs by seed (docs/benchmarks.md 11.1: seed 3's teacher F1 lax 0.943, the others
~0.98), and the student inherits it. This trains the teacher once per seed with the real recipe
(:func:`distillgates.teacher.toy.train_toy_teacher`, the config's ``teacher.train`` with ``ema_decay`` 0) and keeps,
beside the last step's weights, exponential moving averages at several decays and the uniform average (SWA), each over
the last phase's steps (the full conversations, as ``teacher.train.ema_decay`` does). Each is scored as the eval step
scores the teacher: the engine, the drawn held-out items, the same scorer::

    .venv/bin/python benchmarks/bench_teacher_averaging.py --seeds 3 0 --run-dir runs/toy --out /tmp/teacher_avg

``--run-dir`` gives the data and tokenizer (``data.seed`` is the same for every seed, so any build's data serve).
Averages that share one trajectory are compared pairwise: the difference between them is the averaging's alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from distillgates.config import load_config
from distillgates.data.dataset import drawn_items
from distillgates.eval.broker import FixturePolicy
from distillgates.eval.evaluate import evaluate
from distillgates.hf import from_hf
from distillgates.io import atomic_write_json
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.teacher.toy import train_toy_teacher

FIELDS = ("tool_selection", "json_validity", "f1_lax_macro", "fixture_hit_rate")


def train(cfg: Any, run: RunDir, seed: int, decays: list[float], out: Path) -> dict[str, Path]:
    """One trajectory; returns each variant's saved directory (``last``, ``ema<d>``, ``swa``)."""
    tcfg = cfg.teacher.train
    start = tcfg.copy_steps + tcfg.curriculum_steps  # the last phase's first step
    averages: dict[str, AveragedModel] = {}

    def on_step(step: int, model: torch.nn.Module) -> None:
        if step < start:
            return
        if not averages:
            averages.update({f"ema{d}": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d)) for d in decays})
            averages["swa"] = AveragedModel(model)  # the uniform mean
        for average in averages.values():
            average.update_parameters(model)

    cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, train=dataclasses.replace(tcfg,
                                                                                                      ema_decay=0.0)))
    dirs = {"last": out / "last"}
    train_toy_teacher(cfg, run.tokenizer(), run.items("train"), dirs["last"], seed=seed, on_step=on_step)
    for name, average in averages.items():
        dirs[name] = out / name
        average.module.cpu().eval().save_pretrained(dirs[name])
    return dirs


def score(cfg: Any, run: RunDir, model_dir: Path) -> dict[str, Any]:
    """The teacher's figures as the eval step computes them (the drawn items, batch 1)."""
    from transformers import AutoModelForCausalLM

    tokenizer = run.tokenizer()
    engine = TorchEngine(from_hf(AutoModelForCausalLM.from_pretrained(model_dir)).eval())
    quality = evaluate(engine, drawn_items(run.items("eval")), tokenizer, lengths=cfg.shapes.lengths,
                       max_calls=cfg.eval.max_calls, max_new_tokens=cfg.eval.max_new_tokens,
                       policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result), privacy=cfg.eval.privacy)
    return {field: quality[field] for field in FIELDS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 0])
    parser.add_argument("--run-dir", type=Path, default=Path("runs/toy"), help="a toy build: its data and tokenizer")
    parser.add_argument("--decays", type=float, nargs="+", default=[0.99, 0.995, 0.998, 0.999])
    parser.add_argument("--out", type=Path, required=True, help="<out>/seed<S>/<variant>/ and <out>/seed<S>.json")
    args = parser.parse_args()
    cfg, run = load_config(args.config), RunDir(args.run_dir)
    for seed in args.seeds:
        start = time.perf_counter()
        dirs = train(cfg, run, seed, args.decays, args.out / f"seed{seed}")
        result = {"seed": seed, "train_seconds": time.perf_counter() - start, "threads": torch.get_num_threads(),
                  "variants": {name: score(cfg, run, path) for name, path in dirs.items()}}
        atomic_write_json(args.out / f"seed{seed}.json", result)
        print(f"seed {seed} ({result['train_seconds']:.0f} s to train)")
        print("| variant | " + " | ".join(FIELDS) + " |\n" + "|---" * (len(FIELDS) + 1) + "|")
        for name, figures in result["variants"].items():
            cells = ("-" if figures[f] is None else f"{figures[f]:.3f}" for f in FIELDS)
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
