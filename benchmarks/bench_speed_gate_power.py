"""False alarms and power of the speed gates, measured on the real gate path.

Each trial is one real pytest session, in a subprocess, exactly as a user runs it:

    pytest pytest_distillgates/checklist/test_speed.py -m speed --run-dir RUN --baselines-dir BLESSED --speed-mode MODE

on a toy run, wall clock, with the speed workers, the blessed reference and the statistics of
the gates. The slowdown is real and in the engine code: the candidate's ``TorchEngine`` stretches
each prefill/decode call by a fraction of its own duration (``DISTILLGATES_TEST_ENGINE_SLOWDOWN``,
distillgates.runtime.torch_engine; the reference arm never gets it: it stands for a change of
the candidate's code; the stretch is of the call's CPU time, like code doing that much more work). The
speed baselines are blessed once, into a temporary folder, at the start.

Cells: mode (``ab``, ``stored``) x slowdown (0 = A/A, 0.10, 0.20), visited round-robin so that the
machine's load changes hit every cell alike, until ``--sessions`` per cell or ``--until`` (UTC,
HH:MM). A session *fails* when any speed gate fails, is *inconclusive* when none fails and one is
inconclusive, else passes. Results are written after every session.

    .venv/bin/python benchmarks/bench_speed_gate_power.py --run-dir runs/toy --sessions 100 \\
        --out benchmarks/results/speed_gate_power.json
    .venv/bin/python benchmarks/bench_speed_gate_power.py --table benchmarks/results/speed_gate_power.json
    .venv/bin/python benchmarks/bench_speed_gate_power.py --merge all.json run1.json run2.json  # several runs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from distillgates.gates.stats import wilson_interval
from distillgates.hardware import hardware_header
from distillgates.io import atomic_write_json
from distillgates.runtime.torch_engine import SLOWDOWN_ENV

REPO = Path(__file__).resolve().parents[1]


def pytest_session(args: list[str], env: dict[str, str], report: Path) -> tuple[dict[str, Any], float]:
    command = [sys.executable, "-m", "pytest", "pytest_distillgates/checklist/test_speed.py", "-m", "speed", "-q",
               "-p", "no:cacheprovider",
               f"--gate-report={report}", *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if not report.is_file():
        raise RuntimeError(f"{' '.join(command)} wrote no gate report (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    data = json.loads(report.read_text())
    report.unlink()
    if not data["gates"]:
        raise RuntimeError(f"{' '.join(command)} ran no speed gate (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return data, wall


def outcome(gates: list[dict[str, Any]]) -> str:
    verdicts = {g["verdict"] for g in gates}
    return "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    counts = Counter(t["outcome"] for t in trials)
    n = len(trials)
    fail = wilson_interval(counts["fail"], n) if n else None
    return {"sessions": n, "fail": counts["fail"], "pass": counts["pass"], "inconclusive": counts["inconclusive"],
            "fail_rate": counts["fail"] / n if n else None,
            "fail_rate_95ci": [fail.low, fail.high] if fail else None,
            "inconclusive_rate": counts["inconclusive"] / n if n else None,
            "gate_fails": dict(Counter(g for t in trials for g, v in t["gates"].items() if v == "fail")),
            # not decided: the session had already failed another gate (no further round was measured)
            "gate_stopped": dict(Counter(g for t in trials for g, v in t["gates"].items() if v == "stopped")),
            "median_slowdown": {g: sorted(t["slowdowns"][g] for t in trials if t["slowdowns"].get(g))[n // 2]
                                for g in (trials[0]["slowdowns"] if n else {})},
            "median_session_s": sorted(t["wall_s"] for t in trials)[n // 2] if n else None}


def markdown_table(results: dict[str, Any]) -> str:
    """The docs/gates.md table of a results file (``--table``)."""
    gates = ("ttft_ms.p50", "ttft_ms.p95", "tps.p50", "tps.p5")
    rows = ["| mode | injected | sessions | failed (95% CI) | inconclusive | passed | gate fails (TTFT p50/p95, TPS "
            "p50/p5; stopped undecided in brackets) | median measured slowdown (same order) | median session |",
            "|---" * 9 + "|"]
    for key, row in results["summary"].items():
        mode, slowdown = key.split()
        ci = row["fail_rate_95ci"] or [0, 0]
        stopped = row.get("gate_stopped", {})
        fails = "/".join(f"{row['gate_fails'].get(g, 0)}" + (f" ({stopped[g]})" if stopped.get(g) else "")
                         for g in gates)
        measured = " / ".join(f"{row['median_slowdown'].get(g, float('nan')):.2f}" for g in gates)
        rows.append(f"| {mode} | {'A/A' if slowdown == '+0%' else slowdown} | {row['sessions']} | **{row['fail']}** "
                    f"({ci[0]:.0%}-{ci[1]:.0%}) | {row['inconclusive']} | {row['pass']} | {fails} | {measured} | "
                    f"{row['median_session_s']:.0f} s |")
    return "\n".join(rows)


def merge(out: Path, parts: list[Path]) -> None:
    """One results file from several runs (each blessed once): their sessions per cell, and every run's header."""
    runs, trials = [], {}
    for part in parts:
        data = json.loads(part.read_text())
        runs += data.get("runs") or [{k: data[k] for k in ("command", "machine", "started_at", "finished_at",
                                                            "bless_s")}]
        for key, cell in data["trials"].items():
            trials.setdefault(key, []).extend(cell)
    atomic_write_json(out, {"runs": runs, "summary": {k: summary(v) for k, v in trials.items()}, "trials": trials})


def main() -> None:
    if sys.argv[1:2] == ["--table"]:  # print the markdown table of a results file
        print(markdown_table(json.loads(Path(sys.argv[2]).read_text())))
        return
    if sys.argv[1:2] == ["--merge"]:  # --merge OUT RUN.json RUN.json ...
        merge(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a built toy run (read only)")
    parser.add_argument("--sessions", type=int, default=100, help="sessions per cell (mode x slowdown)")
    parser.add_argument("--until", default=None, help="stop starting sessions at this UTC time (HH:MM)")
    parser.add_argument("--modes", nargs="+", choices=["ab", "stored"], default=["ab", "stored"])
    parser.add_argument("--slowdowns", nargs="+", type=float, default=[0.0, 0.10, 0.20])
    parser.add_argument("--pytest-args", default="", help="extra gate options, e.g. '--speed-samples=64'")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    deadline = None
    if args.until:
        hour, minute = (int(x) for x in args.until.split(":"))
        now = dt.datetime.now(dt.UTC)
        deadline = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    env = {k: v for k, v in os.environ.items() if k not in (SLOWDOWN_ENV, "CI")}
    env["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="speed-power-"))
    baselines, report = work / "baselines", work / "report.json"
    common = [f"--run-dir={args.run_dir.resolve()}", f"--baselines-dir={baselines}", *args.pytest_args.split()]
    blessed, bless_s = pytest_session([*common, "--bless"], env, report)
    if outcome(blessed["gates"]) != "pass" or any(g["verdict"] != "blessed" for g in blessed["gates"]):
        raise RuntimeError(f"bless failed: {blessed['gates']}")
    cells = [(mode, slowdown) for mode in args.modes for slowdown in args.slowdowns]
    trials: dict[str, list[dict[str, Any]]] = {f"{m} +{s:.0%}": [] for m, s in cells}
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"hardware": hardware_header(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_at_start": os.getloadavg()},
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bless_s": bless_s, "settings": vars(args) | {"run_dir": str(args.run_dir), "out": str(args.out)},
    }
    for i in range(args.sessions):
        for mode, slowdown in cells:
            if deadline and dt.datetime.now(dt.UTC) >= deadline:
                break
            session_env = env | ({SLOWDOWN_ENV: str(slowdown)} if slowdown else {})
            data, wall = pytest_session([*common, f"--speed-mode={mode}"], session_env, report)
            gates = {g["name"]: g["verdict"] for g in data["gates"]}
            key = f"{mode} +{slowdown:.0%}"
            trials[key].append({"outcome": outcome(data["gates"]), "gates": gates, "wall_s": round(wall, 2),
                                "slowdowns": {g["name"]: g["details"].get("slowdown") for g in data["gates"]},
                                "rounds": max(g["details"].get("rounds", 0) for g in data["gates"]),
                                "load_average": os.getloadavg()[0]})
            print(f"{i:3d} {key:12s} {trials[key][-1]['outcome']:12s} {wall:5.1f}s {gates}", flush=True)
            results |= {"finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                        "summary": {k: summary(v) for k, v in trials.items()}, "trials": trials}
            atomic_write_json(args.out, results)
    shutil.rmtree(work, ignore_errors=True)  # the temporary baselines and reference store
    for key, row in results["summary"].items():
        print(f"{key:12s} sessions {row['sessions']:3d}  fail {row['fail']:3d}  inconclusive {row['inconclusive']:3d}  "
              f"pass {row['pass']:3d}  gate fails {row['gate_fails']}")


if __name__ == "__main__":
    main()
