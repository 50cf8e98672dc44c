"""The main job: data → teacher → KD set → student → drafter → export → speed → eval → report.

Every step is cached by a fingerprint of its inputs (the config sections it reads, the
fingerprints of the steps it depends on, and the package version): a re-run skips finished
steps whose inputs did not change, ``--force`` redoes them. The manifest
(``<run_dir>/manifest.json``) is written atomically after each step, so an interrupted run
resumes at the first unfinished step.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

import distillgates
from distillgates.config import Config, load_config, sha256_json, to_dict
from distillgates.io import atomic_write_json

console = Console(stderr=True)


@dataclass(frozen=True)
class Step:
    name: str
    help: str
    sections: tuple[str, ...]  # config sections whose values change the step's output
    depends: tuple[str, ...]
    run: Callable[[Config, Path], dict[str, Any]]  # returns a small JSON summary


class Pipeline:
    """Runs steps in order with fingerprint caching and a manifest."""

    def __init__(self, cfg: Config, run_dir: Path, force: bool = False) -> None:
        self.cfg, self.run_dir, self.force = cfg, run_dir, force
        self.manifest_path = run_dir / "manifest.json"
        self.manifest: dict[str, Any] = (
            json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}
        )

    def fingerprint(self, step: Step) -> str:
        sections = {name: to_dict(getattr(self.cfg, name)) for name in step.sections}
        upstream = {dep: self.manifest.get(dep, {}).get("fingerprint") for dep in step.depends}
        return sha256_json({"step": step.name, "sections": sections, "upstream": upstream, "seed": self.cfg.seed,
                            "version": distillgates.__version__})

    def is_fresh(self, step: Step) -> bool:
        entry = self.manifest.get(step.name)
        return bool(entry) and entry.get("fingerprint") == self.fingerprint(step)

    def run_step(self, step: Step, force: bool | None = None) -> dict[str, Any]:
        force = self.force if force is None else force
        if not force and self.is_fresh(step):
            console.print(f"[dim]✓ {step.name}: cached ({self.manifest[step.name]['seconds']:.1f}s before)[/dim]")
            return self.manifest[step.name]["summary"]
        console.rule(f"[bold]{step.name}[/bold] — {step.help}")
        started = time.perf_counter()
        summary = step.run(self.cfg, self.run_dir)
        seconds = time.perf_counter() - started
        self.manifest[step.name] = {
            "fingerprint": self.fingerprint(step),
            "seconds": round(seconds, 2),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "summary": summary,
        }
        atomic_write_json(self.manifest_path, self.manifest)
        console.print(f"[green]✓ {step.name}[/green] in {seconds:.1f}s")
        return summary

    def run(self, names: list[str] | None = None) -> dict[str, Any]:
        for step in STEPS:
            if names is None or step.name in names:
                missing = [d for d in step.depends if d not in self.manifest and (names and d not in names)]
                if missing:
                    raise FileNotFoundError(
                        f"step {step.name!r} needs {', '.join(missing)} first: run `distillgates "
                        f"{missing[0]} ...` or `distillgates run ...` with the same --run-dir ({self.run_dir})"
                    )
                self.run_step(step)
        return self.manifest


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / cfg.name


def run_pipeline(config_path: str | Path, run_dir: str | Path | None = None, force: bool = False) -> Path:
    """Run the whole pipeline; returns the run directory (``reports/report.json`` inside)."""
    cfg = load_config(config_path)
    run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
    started = time.perf_counter()
    Pipeline(cfg, run_dir, force).run()
    console.print(f"[bold]pipeline finished in {time.perf_counter() - started:.0f}s[/bold] → {run_dir}")
    return run_dir


STEPS: list[Step] = []


# --------------------------------------------------------------------------------------
# CLI entry points (wired in cli.py)


def cli_run(args: argparse.Namespace) -> int:
    run_dir = run_pipeline(args.config, args.run_dir, args.force)
    return cli_report(argparse.Namespace(path=str(run_dir / "reports" / "report.json"), markdown=None))


def cli_step(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    pipeline = Pipeline(cfg, run_dir, args.force)
    step = next(s for s in STEPS if s.name == args.step)
    missing = [d for d in step.depends if d not in pipeline.manifest]
    if missing:
        raise FileNotFoundError(
            f"step {step.name!r} needs {', '.join(missing)} in {run_dir} first: run `distillgates {missing[0]} "
            f"{args.config} --run-dir {run_dir}` (or `distillgates run`)"
        )
    summary = pipeline.run_step(step, force=args.force)
    console.print_json(data=summary)
    return 0


def cli_report(args: argparse.Namespace) -> int:
    raise SystemExit("report rendering is wired when distillgates.eval lands")


def cli_profile(args: argparse.Namespace) -> int:
    raise SystemExit("profile is wired when distillgates.hardware lands")
