"""Shared helpers for the runtime benchmarks (not a test module)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from distillgates.config import ModelConfig, load_config
from distillgates.model import Transformer, load_model
from distillgates.project import EMBEDDED_CONFIG


def common_args(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--run-dir", default=None, help="use trained checkpoints from a pipeline run dir")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared 2-core box: 1)")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def toy_model(args: argparse.Namespace, role: str = "student", max_seq_len: int | None = None) -> Transformer:
    """The trained checkpoint of ``role`` from ``--run-dir``, else random weights of the config's shape."""
    torch.set_num_threads(args.threads)
    if args.run_dir:
        model = load_model(Path(args.run_dir) / role / "model.pt")
        if max_seq_len and model.config.max_seq_len < max_seq_len:
            raise SystemExit(f"{role} max_seq_len {model.config.max_seq_len} < {max_seq_len} needed")
        return model.eval()
    cfg: ModelConfig = getattr(load_config(args.config), role)
    if max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs; raw samples too."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples
