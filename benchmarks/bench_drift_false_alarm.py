"""False-alarm rate of the quality drift gates on the real path: retrain the student with other seeds.

A student retrained with another ``train.seed`` (same data, teacher, KD set and recipe) is not a
regression: it is the noise a recipe change that does not matter would make. This bench blesses the
drift gates (``f1_drift``, ``shape_drift``) on a finished run, retrains the student of a copy of that
run with each seed (``distillgates run`` with ``train.seed``: the student and the steps after it
re-run, data/teacher/KD stay cached), gates each copy against the blessed baseline with the shipped
checklist, and counts how often the drift gates fire: with the paired per-item rule the gates use,
and with the raw-mean rule they replaced (current mean - blessed mean < -tolerance).

    .venv/bin/python benchmarks/bench_drift_false_alarm.py --run-dir runs/toy --seeds 1 2 3 \\
        --work /tmp/drift-bench --out benchmarks/results/drift_false_alarm.json

The detection side: ``--set train.steps=150`` (dotted config assignments, YAML values) retrains a
worse student the same way; there the gates should fire.

A seed whose run already holds a report (``WORK/seed<S>/reports/report.json``) is gated again without
retraining. Each retrain takes ~3 min on 2 idle cores (toy config).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from distillgates.io import atomic_write_json
from distillgates.project import EMBEDDED_CONFIG

CHECKLIST = Path(__file__).resolve().parents[1] / "pytest_distillgates" / "checklist"
GATES = [str(CHECKLIST / "test_f1_drift.py"), str(CHECKLIST / "test_shape_drift.py")]


def gate(run_dir: Path, baselines: Path, report: Path, bless: bool = False) -> list[dict]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GATES, f"--run-dir={run_dir}",
           f"--baselines-dir={baselines}", f"--gate-report={report}", *(["--bless"] if bless else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1) or not report.exists():
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(report.read_text())["gates"]


def retrain(base: Path, config: Path, seed: int, run_dir: Path, assignments: list[str]) -> None:
    if (run_dir / "reports" / "report.json").exists():
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(base, run_dir)
    cfg = yaml.safe_load(config.read_text())
    for assignment in [f"train.seed={seed}", *assignments]:
        key, _, value = assignment.partition("=")
        *parents, leaf = key.split(".")
        section = cfg
        for name in parents:
            section = section.setdefault(name, {})
        section[leaf] = yaml.safe_load(value)
    seeded = run_dir.parent / f"config-{run_dir.name}.yaml"
    seeded.write_text(yaml.safe_dump(cfg, sort_keys=False))
    subprocess.run([sys.executable, "-m", "distillgates.cli", "run", str(seeded), "--run-dir", str(run_dir)],
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="finished run: the blessed student")
    parser.add_argument("--config", type=Path, default=EMBEDDED_CONFIG, help="the run's pipeline config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--set", dest="assignments", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config changes on top of the seed (detection runs), e.g. train.steps=150")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    baselines = args.work / "baselines"
    gate(args.run_dir, baselines, args.work / "bless.json", bless=True)
    rows = []
    for seed in args.seeds:
        run_dir = args.work / "-".join([f"seed{seed}", *args.assignments])
        retrain(args.run_dir, args.config, seed, run_dir, args.assignments)
        for rec in gate(run_dir, baselines, args.work / f"gates-seed{seed}.json"):
            d = rec["details"]
            rows.append({"seed": seed, "gate": f"{rec['group']}/{rec['name']}", "n": d["n"],
                         "n_changed": d["n_changed"], "mean_change": d["mean_change"], "p_value": d["p_value"],
                         "paired_fires": rec["verdict"] == "fail",
                         "raw_mean_fires": rec["measured"] - rec["baseline"] < -d["tolerance"]})
    for row in rows:
        print(f"seed {row['seed']} {row['gate']:<36} n={row['n']:<4} changed={row['n_changed']:<3} "
              f"mean {row['mean_change']:+.4f} p={row['p_value']:.3g} paired={'FIRE' if row['paired_fires'] else 'ok'} "
              f"raw-mean={'FIRE' if row['raw_mean_fires'] else 'ok'}")
    seeds = sorted({r["seed"] for r in rows})
    summary = {rule: {"gate_verdicts_fired": sum(r[f"{rule}_fires"] for r in rows), "gate_verdicts": len(rows),
                      "seeds_with_any_fire": sum(any(r[f"{rule}_fires"] for r in rows if r["seed"] == s)
                                                 for s in seeds), "seeds": len(seeds)}
               for rule in ("paired", "raw_mean")}
    print(json.dumps(summary, indent=1))
    if args.out:
        atomic_write_json(args.out, {"run_dir": str(args.run_dir), "seeds": seeds, "set": args.assignments,
                                     "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
