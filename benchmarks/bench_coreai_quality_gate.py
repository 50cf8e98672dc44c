"""False alarms of the Core AI quality gates on a real build: a threshold on the sample vs the corrected figure.

The ``coreai_eval`` step decodes a random sample of ``export.coreai_eval_items`` (32) drawn eval items through
``export/model.aimodel``. Gating the sample's own figures against the quality thresholds decides on ~30 calls; the
gates now take the eval step's figures over every drawn item corrected by the sample's asset-minus-PyTorch
differences (:func:`pytest_distillgates.fixtures.corrected_figure`). This bench decodes **every** drawn eval item of a
finished run through its asset once (the real ``coreai_eval`` step, Core AI's runtime, on a copy of the run), then
draws ``--samples`` random samples of ``--items`` of them and counts how often each rule fails each quality gate:
what the gate would have said on every other sample the step could have drawn, from the asset's real outputs::

    .venv/bin/python benchmarks/bench_coreai_quality_gate.py --run-dir runs/toy --work /tmp/coreai-gate \\
        --out benchmarks/results/coreai_quality_gate.json

A student whose eval figures clear the thresholds should fail neither. Decoding the ~200 items takes ~10 min on 2
cores (the reference runtime, one thread per worker process); a work dir that holds them already is reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from distillgates.data.dataset import drawn_items
from distillgates.io import atomic_write_json
from distillgates.pipeline import coreai_eval_path, load_run, step_coreai_eval
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from pytest_distillgates.checklist.test_coreai_parity import QUALITY
from pytest_distillgates.fixtures import corrected_figure, item_figures


def decode_every_item(run_dir: Path, config: Path, work: Path) -> tuple[list[dict], dict]:
    """(PyTorch's drawn rows, the coreai_eval step's figures of every drawn item), decoded in a copy of the run."""
    copy = RunDir(work / "run")
    path = coreai_eval_path(copy)
    measured = json.loads(path.read_text()) if path.exists() else {}
    if measured.get("sampled") != "all":
        shutil.rmtree(copy.root, ignore_errors=True)
        shutil.copytree(run_dir, copy.root)
        cfg, _ = load_run(config, copy.root)
        every = len(drawn_items(copy.items("eval")))
        step_coreai_eval(dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, coreai_eval_items=every)),
                         copy)
        measured = {**json.loads(path.read_text()), "sampled": "all"}
        atomic_write_json(path, measured)
    rows = [row for row in copy.student_item_scores() if not row.get("top_up")]  # the drawn items, as the gates'
    return rows, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished run with export.target both")
    parser.add_argument("--config", type=Path, default=EMBEDDED_CONFIG, help="the run's pipeline config")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--items", type=int, default=32, help="the sample size (export.coreai_eval_items)")
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    thresholds = load_run(args.config, args.run_dir)[0].gates
    rows, measured = decode_every_item(args.run_dir, args.config, args.work)
    asset = measured["item_scores"]
    eval_figures, asset_figures = item_figures(rows), item_figures(asset)
    rng = np.random.default_rng(args.seed)
    fails = {rule: {metric: 0 for metric in QUALITY} for rule in ("sample", "corrected")}
    any_fail = dict.fromkeys(fails, 0)
    for _ in range(args.samples):
        sample = [asset[i] for i in sorted(rng.choice(len(asset), args.items, replace=False))]
        figures = {"sample": item_figures(sample),
                   "corrected": {m: corrected_figure(rows, sample, m)[0] for m in QUALITY}}
        for rule, figure in figures.items():
            failed = [m for m, field in QUALITY.items()
                      if figure[m] is not None and figure[m] < getattr(thresholds, field)]
            any_fail[rule] += bool(failed)
            for metric in failed:
                fails[rule][metric] += 1
    summary = {"items": len(rows), "outputs_identical": measured["identical"], "differing": measured["differing_ids"],
               "sample_items": args.items,
               "samples": args.samples, "thresholds": {m: getattr(thresholds, f) for m, f in QUALITY.items()},
               "eval_figures": eval_figures, "asset_figures_every_item": asset_figures,
               "fail_rate": {rule: {m: n / args.samples for m, n in per.items()} for rule, per in fails.items()},
               "any_gate_fail_rate": {rule: n / args.samples for rule, n in any_fail.items()}}
    print(json.dumps(summary, indent=1))
    if args.out:
        atomic_write_json(args.out, {"run_dir": str(args.run_dir), **summary})


if __name__ == "__main__":
    main()
