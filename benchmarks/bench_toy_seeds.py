"""The toy's verdicts across seeds: how much margin each embedded gate has when the student comes out different.

Seeds stand in for machines: another CPU kind (or torch version, or thread count) changes float results, and the
toy's training amplifies them into another student. ``--seed`` replaces the config's top-level seed (teacher,
student and drafter initialisation, batch order) and keeps ``data.seed``, so every build is scored on the same eval
set and gated against the same committed drift baselines.

For each seed: ``distillgates run --seed S`` (or, with ``--quality-only``, its data, teacher, check, kd, student and
eval steps: what the quality and drift gates read), then a table of the student's gated figures next to their
thresholds, the worst seed's margin, and each drift slice against ``--baselines`` (verdict, detectable drop,
powered or not), as the checklist computes them::

    .venv/bin/python benchmarks/bench_toy_seeds.py --seeds 0 1 2 3 4 --runs-root /tmp/toyseeds
    .venv/bin/python benchmarks/bench_toy_seeds.py --seeds 0 1 --runs-root /tmp/toyseeds --report-only

Run dirs are reused (the pipeline's cache): ``--report-only`` tabulates finished runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from distillgates.config import load_config
from distillgates.gates.stats import POWER_FACTOR, compare_paired
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir

QUALITY_STEPS = ("data", "teacher", "check", "kd", "student", "eval")
# (report field, gate threshold field, higher is better)
FIGURES = (("tool_selection", "tool_selection_min", True), ("json_validity", "json_validity_min", True),
           ("f1_lax_macro", "f1_lax_min", True), ("fixture_hit_rate", "fixture_hit_rate_min", True),
           ("ttfa_tokens_p95", "ttfa_p95_tokens_max", False), ("median_tokens_ratio", "median_tokens_ratio_max", False))


def build(config: str, seed: int, run_dir: Path, quality_only: bool) -> float:
    """Run the real command for one seed; returns its wall-clock seconds."""
    start = time.perf_counter()
    commands = ([[step, config] for step in QUALITY_STEPS] if quality_only else [["run", config]])
    for args in commands:
        subprocess.run([sys.executable, "-m", "distillgates", *args, "--seed", str(seed), "--run-dir", str(run_dir)],
                       check=True)
    return time.perf_counter() - start


def drift(run_dir: Path, baselines: Path, tolerance: float, alpha: float) -> dict[str, Any]:
    """Each drift slice of the run against the committed baselines, as the shape_drift and f1_drift gates test it."""
    rows = json.loads((run_dir / "eval" / "item_scores.json").read_text())["items"]
    out = {}
    for group in ("f1_drift", "shape_drift"):
        for key, entry in json.loads((baselines / f"{group}.json").read_text())["entries"].items():
            field = "f1_strict" if "strict" in key else "f1_lax"
            shape = key.rsplit(".", 1)[1] if ".shape." in key else None
            current = {r["id"]: r[field] for r in rows if r[field] is not None and shape in (None, r["shape"])}
            out[key] = compare_paired(entry["items"], current, tolerance=tolerance, alpha=alpha)
    return out


def by_tool(run_dir: Path) -> dict[str, float]:
    """The student's mean F1 lax per expected tool over the whole eval set, two-call items pooled: where the builds'
    spread lives (docs/benchmarks.md 11.1)."""
    tools = {item["id"]: item["expected_calls"][0]["name"] if len(item["expected_calls"]) == 1 else "two-call"
             for item in RunDir(run_dir).items("eval") if item["expected_calls"]}
    groups: dict[str, list[float]] = {}
    for row in json.loads((run_dir / "eval" / "item_scores.json").read_text())["items"]:
        if row["f1_lax"] is not None:
            groups.setdefault(tools.get(row["id"], "no call"), []).append(row["f1_lax"])
    return {tool: sum(v) / len(v) for tool, v in sorted(groups.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs-root", type=Path, required=True, help="one run dir per seed: <root>/seed<S>")
    parser.add_argument("--baselines", type=Path, default=Path("baselines/common"))
    parser.add_argument("--quality-only", action="store_true", help="only the steps the quality and drift gates read")
    parser.add_argument("--report-only", action="store_true", help="tabulate finished runs, build nothing")
    args = parser.parse_args()
    gates = load_config(args.config).gates
    seconds = {}
    for seed in args.seeds:
        if not args.report_only:
            seconds[seed] = build(args.config, seed, args.runs_root / f"seed{seed}", args.quality_only)
    print("| seed | " + " | ".join(f for f, _, _ in FIGURES) + " | teacher F1 lax | build s |")
    print("|---" * (len(FIGURES) + 3) + "|")
    worst: dict[str, float] = {}
    drifts = {}
    for seed in args.seeds:
        run_dir = args.runs_root / f"seed{seed}"
        quality = json.loads((run_dir / "eval" / "quality.json").read_text())
        student, teacher = quality["student"], quality["teacher"]
        tokens = "median_tokens_out_tool_items"
        student["median_tokens_ratio"] = student[tokens] / teacher[tokens]
        cells = []
        for field, threshold, higher in FIGURES:
            value = student[field]
            margin = value - getattr(gates, threshold) if higher else getattr(gates, threshold) - value
            worst[field] = min(worst.get(field, margin), margin)
            cells.append(f"{value:.3f}" if isinstance(value, float) and value <= 1 else f"{value}")
        took = f"{seconds[seed]:.0f}" if seed in seconds else "-"
        print(f"| {seed} | " + " | ".join(cells) + f" | {teacher['f1_lax_macro']:.3f} | {took} |")
        drifts[seed] = drift(run_dir, args.baselines, gates.shape_drift_max, gates.significance_alpha)
    tools = {seed: by_tool(args.runs_root / f"seed{seed}") for seed in args.seeds}
    names = list(tools[args.seeds[0]])
    print("\nstudent F1 lax by expected tool, whole eval set\n| seed | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for seed, means in tools.items():
        print(f"| {seed} | " + " | ".join(f"{means.get(t, float('nan')):.3f}" for t in names) + " |")
    print("\nworst seed's margin to each gate: " + ", ".join(f"{f} {m:+.3f}" for f, m in worst.items()))
    print(f"\ndrift vs {args.baselines} (tolerance {gates.shape_drift_max}, alpha {gates.significance_alpha}; "
          f"powered: detects {POWER_FACTOR:g}x the tolerance)")
    print("| seed | slice | verdict | mean change | detectable drop | spread | powered |")
    print("|---|---|---|---|---|---|---|")
    for seed, slices in drifts.items():
        for key, r in slices.items():
            print(f"| {seed} | {key} | {r.verdict} | {r.mean_change:+.4f} | {r.detectable_drop:.4f} | {r.spread:.3f} | "
                  f"{'no' if r.underpowered else 'yes'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
