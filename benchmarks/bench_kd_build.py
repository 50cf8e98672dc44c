"""KD-set build throughput of the local teacher: batched (kd.batch_size) vs one conversation at a time.

Usage: .venv/bin/python benchmarks/bench_kd_build.py TEACHER_DIR [--items 128] [--batch 32]
Prints items/s for both and the ratio (the pipeline budget is ~2000 toy items in < 60 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from distillgates.config import load_config
from distillgates.data.generator import generate_items
from distillgates.project import EMBEDDED_CONFIG
from distillgates.teacher.kd import build_kd_set
from distillgates.teacher.local import LocalTeacher


class _OneByOne:
    """The same teacher without ``complete_batch``: the builder then calls ``complete`` per conversation."""

    def __init__(self, inner: LocalTeacher) -> None:
        self.inner, self.model_id, self.tokenizer = inner, inner.model_id, inner.tokenizer

    def complete(self, messages, **kwargs):
        return self.inner.complete(messages, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("teacher_dir")
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, batch_size=args.batch))
    items = generate_items(cfg.data.seed, args.items, cfg.data.locales, "train")
    teacher = LocalTeacher(args.teacher_dir)
    rates = {}
    for name, t in (("batched", teacher), ("one_by_one", _OneByOne(teacher))):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            build_kd_set(cfg, t, items, Path(tmp) / "kd.jsonl", progress=False)
            rates[name] = args.items / (time.perf_counter() - start)
        print(f"{name:>10}: {rates[name]:.1f} items/s")
    print(f"batched / one_by_one: {rates['batched'] / rates['one_by_one']:.2f}x")


if __name__ == "__main__":
    main()
