"""How often the speculative gates decide, per ``speed.speculative_workers`` x ``speed.speculative_samples`` plan.

Replays the pipeline's own measurement (``gates.speed_ab.speculative_speedup``: fresh speed worker processes, each
timing plain and speculative decoding interleaved) on a built run, and decides each repeat with
``gates.stats.compare_speedup`` as the checklist does: TTFT (plain / speculative, minimum
``speculative_ttft_speedup_min``) and TPS (speculative / plain, minimum ``speculative_speedup_min``), at the
project's thresholds (run from its folder) and ``significance_alpha``. The plans are interleaved within a repeat, so
a slow stretch of the machine falls on each. Prints one JSON line per decision and the count of non-pass TTFT
decisions per plan (docs/gates.md, the TTFT gate's paragraph).

Usage (from the repository root; nothing else running: the timings are the point)::

    .venv/bin/python benchmarks/bench_speculative_gate_power.py runs/toy --plans 6x16,8x32,12x24 --repeats 6

``--noise`` runs a busy loop on the speed workers' CPU while measuring, in stretches of 0.05-0.5 s with 0.1-1 s
idle between them (seeded): the slow stretches of a shared CI runner, which the processes' interleaving must cancel.
With ``PYTHONPATH=<another checkout>/src`` it measures that checkout's ``speculative_speedup`` (docs/gates.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np

from distillgates.gates.speed_ab import speculative_speedup
from distillgates.gates.stats import compare_speedup
from distillgates.project import Project
from distillgates.rundir import RunDir

NOISE = """import os, random, time
os.sched_setaffinity(0, {%d})
rng = random.Random(0)
while True:
    end = time.perf_counter() + rng.uniform(0.05, 0.5)
    while time.perf_counter() < end:
        pass
    time.sleep(rng.uniform(0.1, 1.0))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a pipeline run with its student and drafter, e.g. runs/toy")
    parser.add_argument("--plans", default="6x16,8x32", help="WORKERSxSAMPLES, comma-separated")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--noise", action="store_true", help="a busy loop in stretches on the workers' CPU")
    args = parser.parse_args()
    # on the CPU speculative_speedup pins its workers to
    noise = subprocess.Popen([sys.executable, "-c", NOISE % max(os.sched_getaffinity(0))]) if args.noise else None
    try:
        decide(args)
    finally:
        if noise is not None:
            noise.kill()


def decide(args: argparse.Namespace) -> None:
    run, thresholds = RunDir(args.run_dir), Project.load(".").thresholds().values  # the checklist's
    plans = [tuple(map(int, plan.split("x"))) for plan in args.plans.split(",")]
    misses: Counter[str] = Counter()
    for rep in range(args.repeats):
        for workers, samples in plans:
            start = time.perf_counter()
            got = speculative_speedup(run, workers=workers, samples=samples)
            wall = time.perf_counter() - start
            alpha = thresholds.significance_alpha
            ttft = compare_speedup(got["ttft_speculative"], got["ttft_plain"],
                                   minimum=thresholds.speculative_ttft_speedup_min, test_alpha=alpha)
            tps = compare_speedup(got["tps_plain"], got["tps_speculative"], minimum=thresholds.speculative_speedup_min,
                                  test_alpha=alpha)
            plan = f"{workers}x{samples}"
            misses[plan] += ttft.verdict != "pass"
            print(json.dumps({"repeat": rep, "plan": plan, "wall_s": round(wall, 1),
                              **{name: {"verdict": c.verdict, "speedup": round(c.speedup, 4),
                                        "ci": [round(c.ci_low, 4), round(c.ci_high, 4)]}
                                 for name, c in (("ttft", ttft), ("tps", tps))},
                              "ttft_per_process": [round(float(np.median(p) / np.median(s)), 3)
                                                   for p, s in zip(got["ttft_plain"], got["ttft_speculative"],
                                                                   strict=True)]}), flush=True)
    print(json.dumps({"ttft_not_pass": {f"{w}x{s}": f"{misses[f'{w}x{s}']}/{args.repeats}" for w, s in plans}}))


if __name__ == "__main__":
    main()
