"""False-alarm rate and power of the statistical speed gate under real measurement noise.

Each sample is the wall time of a small real PyTorch workload (a tiny GQA transformer forward
at batch 1, one thread) on this machine, with whatever load the machine has. Two experiments,
each repeated ``--trials`` times, in both gate modes:

- **A/A**: candidate = the same code as the reference. Any ``fail`` is a false alarm.
- **A/B**: candidate does 10% more work (the forward pass repeated 11 times instead of 10), a
  real 10% slowdown. A ``fail`` is a detection.

Unpaired mode blesses the reference samples first and then measures the candidate (like CI
comparing with a stored baseline); paired mode interleaves reference and candidate (ABBA).
Two clocks: wall time (``perf_counter``, what a user feels) and the thread's CPU time
(``thread_time``, blind to the time the scheduler gives to other processes on a shared runner).

    .venv/bin/python benchmarks/bench_speed_gate_power.py --trials 20 --out benchmarks/results/speed_gate_power.json
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch

from distillgates.config import ModelConfig
from distillgates.gates.stats import sequential_speed_gate
from distillgates.io import atomic_write_json
from distillgates.model import Transformer

REPS = 10  # forward passes per sample in the reference workload; the slow candidate does 11


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def make_workload(reps: int, clock=time.perf_counter):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 32))

    def measure(n: int) -> list[float]:
        samples = []
        with torch.inference_mode():
            for _ in range(n):
                start = clock()
                for _ in range(reps):
                    model(ids)  # (1, 32, V)
                samples.append((clock() - start) * 1e3)  # ms
        return samples

    measure(3)  # warm-up
    return measure


def trial(reference, candidate, paired: bool, args: argparse.Namespace, seed: int) -> dict:
    common = dict(samples=args.samples, max_extra_rounds=args.max_extra_rounds, threshold=args.threshold,
                  higher_is_better=False, alpha=args.alpha, seed=seed)
    if paired:
        result, _, cand = sequential_speed_gate(candidate, measure_reference=reference, **common)
    else:
        result, _, cand = sequential_speed_gate(candidate, reference=reference(args.samples), **common)
    return {"verdict": result.verdict, "slowdown": result.slowdown, "p_value": result.p_value,
            "rounds": result.rounds, "n_candidate": len(cand)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--max-extra-rounds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--clocks", nargs="+", choices=sorted(CLOCKS), default=["wall", "cpu"])
    parser.add_argument("--modes", nargs="+", choices=["unpaired", "paired"], default=["unpaired", "paired"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for clock_name in args.clocks:
        clock = CLOCKS[clock_name]
        same, slower, reference = (make_workload(REPS, clock), make_workload(REPS + 1, clock),
                                   make_workload(REPS, clock))
        for mode in args.modes:
            for experiment, candidate in (("A/A", same), ("A/B +10%", slower)):
                trials = [trial(reference, candidate, mode == "paired", args, seed) for seed in range(args.trials)]
                counts = Counter(t["verdict"] for t in trials)
                slowdowns = sorted(t["slowdown"] for t in trials)
                key = f"{clock_name} {mode} {experiment}"
                rows[key] = r = {
                    "trials": args.trials, "fail": counts["fail"], "pass": counts["pass"],
                    "inconclusive": counts["inconclusive"], "fail_rate": counts["fail"] / args.trials,
                    "median_slowdown": slowdowns[len(slowdowns) // 2], "min_slowdown": slowdowns[0],
                    "max_slowdown": slowdowns[-1], "mean_rounds": sum(t["rounds"] for t in trials) / args.trials,
                    "trials_detail": trials,
                }
                print(f"{key:24s} fail {r['fail']:3d}/{args.trials}  pass {r['pass']:3d}  "
                      f"inconclusive {r['inconclusive']:3d}  slowdown median {r['median_slowdown']:.3f} "
                      f"[{r['min_slowdown']:.3f}, {r['max_slowdown']:.3f}]  rounds {r['mean_rounds']:.2f}", flush=True)
    if args.out:
        atomic_write_json(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                     "workload": f"tiny transformer forward x{REPS} (x{REPS + 1} slow), 1 thread",
                                     "torch": torch.__version__, "results": rows})


if __name__ == "__main__":
    main()
