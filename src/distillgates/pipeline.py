"""The main job: data → teacher → KD set → student → drafter → export → speed → eval → report.

Every step is cached by a fingerprint of its inputs (the config sections it reads, the
fingerprints of the steps it depends on, and the package version): a re-run skips finished
steps whose inputs did not change, ``--force`` redoes them. The manifest
(``<run_dir>/manifest.json``) is written atomically after each step, so an interrupted run
resumes at the first unfinished step.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
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
    out: str | None = None  # the step's own folder in the run dir (cleared when its inputs change)
    resumable: bool = False  # an interrupted run of the same inputs continues from its checkpoint


@functools.cache
def code_version() -> str:
    """sha256 over the package's sources: a code change invalidates cached steps too."""
    package = Path(distillgates.__file__).parent
    digest = hashlib.sha256(distillgates.__version__.encode())
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.json")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


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
                            "code": code_version()})

    def is_fresh(self, step: Step) -> bool:
        entry = self.manifest.get(step.name)
        return bool(entry and entry.get("fingerprint") == self.fingerprint(step))

    def run_step(self, step: Step, force: bool | None = None) -> dict[str, Any]:
        force = self.force if force is None else force
        if not force and self.is_fresh(step):
            console.print(f"[dim]✓ {step.name}: cached ({self.manifest[step.name]['seconds']:.1f}s before)[/dim]")
            return self.manifest[step.name]["summary"]
        console.rule(f"[bold]{step.name}[/bold] — {step.help}")
        self._prepare_output(step, force)
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

    def _prepare_output(self, step: Step, force: bool) -> None:
        """Keep a resumable step's folder only when the interrupted attempt had the same inputs."""
        if step.out is None:
            return
        fingerprint = self.fingerprint(step)
        started = self.manifest.get("_started", {}).get(step.name)
        out = self.run_dir / step.out
        if out.exists() and (force or not step.resumable or started != fingerprint):
            shutil.rmtree(out)
        self.manifest.setdefault("_started", {})[step.name] = fingerprint
        atomic_write_json(self.manifest_path, self.manifest)

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


def set_threads(cfg: Config) -> None:
    import torch

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / cfg.name


def run_pipeline(config_path: str | Path, run_dir: str | Path | None = None, force: bool = False) -> Path:
    """Run the whole pipeline; returns the run directory (``reports/report.json`` inside)."""
    cfg = load_config(config_path)
    run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
    set_threads(cfg)
    started = time.perf_counter()
    Pipeline(cfg, run_dir, force).run()
    console.print(f"[bold]pipeline finished in {time.perf_counter() - started:.0f}s[/bold] → {run_dir}")
    return run_dir


# --------------------------------------------------------------------------------------
# Steps


def step_data(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.data.build import build_toy_data

    toy = build_toy_data(cfg, run_dir / "data")
    return {
        "tokenizer_fingerprint": toy.tokenizer_fingerprint,
        "dataset_sha256": toy.dataset_sha256,
        "dropped": {split: len(ids) for split, ids in toy.dropped.items()},
        "shape_counts": {split: {str(k): v for k, v in c.items()} for split, c in toy.shape_counts.items()},
    }


def _train_items(run_dir: Path) -> list[dict[str, Any]]:
    from distillgates.data.dataset import read_dataset

    return read_dataset(run_dir / "data" / "train.jsonl")[1]


def _teacher(cfg: Config, run_dir: Path) -> Any:
    """The local teacher: ``teacher.path`` when given, else the toy teacher this run trained."""
    from distillgates.teacher.local import LocalTeacher

    assert cfg.teacher is not None
    return LocalTeacher(cfg.teacher.path or run_dir / "teacher")


def step_teacher(cfg: Config, run_dir: Path) -> dict[str, Any]:
    if cfg.teacher is None:
        raise ValueError("config has no teacher section")
    if cfg.teacher.kind == "openai":
        return {"kind": "openai", "base_url": cfg.teacher.base_url, "model": cfg.teacher.model_name}
    if cfg.teacher.path:  # a given AutoModelForCausalLM directory: nothing to train
        return {"kind": "local", "path": cfg.teacher.path}
    from distillgates.teacher.toy import build_toy_teacher

    report = build_toy_teacher(cfg, _tokenizer(run_dir), _train_items(run_dir), _eval_items(run_dir),
                               run_dir / "teacher")
    return {key: report[key] for key in ("tool_selection", "json_validity", "n") if key in report}


def step_kd(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.teacher.kd import build_kd_set

    assert cfg.teacher is not None
    if cfg.teacher.kind == "openai":
        from distillgates.teacher.http import HTTPTeacher

        teacher: Any = HTTPTeacher(cfg.teacher, _tokenizer(run_dir))
    else:
        teacher = _teacher(cfg, run_dir)
    out = run_dir / "kd" / "kd.jsonl"
    # resume is safe: the builder refuses a checkpoint of another build (different teacher/items); the
    # response cache lives outside kd/ so it survives a config change (keys are request hashes)
    result = build_kd_set(cfg, teacher, _train_items(run_dir), out, resume=True, cache_dir=run_dir / "cache" / "kd")
    if not result.complete:
        raise RuntimeError(f"KD set incomplete: {result.message}")
    # gate_inputs.teacher: an API teacher's KD set is reproducible only in determinism mode with no retry
    atomic_write_json(run_dir / "kd" / "build.json", {
        "kind": cfg.teacher.kind, "determinism": cfg.teacher.determinism, "retries": result.retries,
        "cache_hits": result.cache_hits, "records": result.n_done, "tokens": result.spent_tokens,
    })
    return {"records": result.n_done, "tokens": result.spent_tokens, "status": result.status}


def _train(role: str) -> Callable[[Config, Path], dict[str, Any]]:
    def step(cfg: Config, run_dir: Path) -> dict[str, Any]:
        from distillgates.train import train_student

        path = train_student(cfg, role, run_dir, kd_path=run_dir / "kd" / "kd.jsonl")
        summary: dict[str, Any] = {"model": str(path)}
        probe = run_dir / role / "qat_probe.json"
        if probe.exists():
            summary["qat_probe_cosine_min"] = json.loads(probe.read_text()).get("probe_cosine_min")
        return summary

    return step


def _tokenizer(run_dir: Path) -> Any:
    from distillgates.tokenizer import load_tokenizer

    return load_tokenizer(run_dir / "data" / "tokenizer")


def _eval_items(run_dir: Path) -> list[dict[str, Any]]:
    from distillgates.data.dataset import read_dataset

    return read_dataset(run_dir / "data" / "eval.jsonl")[1]


def step_export(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.export import export_model
    from distillgates.tokenizer import tokenizer_fingerprint

    result = export_model(
        run_dir / "student" / "model.pt", cfg, run_dir / "export", tokenizer_fingerprint(_tokenizer(run_dir))
    )
    atomic_write_json(run_dir / "export" / "gate_inputs.json", result.gate_inputs)
    return {
        "packages": {name: str(path) for name, path in result.packages.items()},
        "ane_estimated_share": result.gate_inputs["ane"]["estimated_share"],
        "cosine_by_shape": result.gate_inputs["export"]["cosine_by_shape"],
    }


def step_speed(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.speed import run_speed

    report = run_speed(cfg, run_dir)
    speed = report["speed"]
    return {"ttft_ms_p50": speed["ttft_ms"]["p50"], "tps_p50": speed["tps"]["p50"], "backend": speed["backend"]}


def step_eval(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.data.fingerprints import dataset_sha256
    from distillgates.eval import evaluate
    from distillgates.eval.evaluate import sharded_determinism
    from distillgates.model import from_hf, load_model
    from distillgates.runtime import TorchEngine
    tokenizer, items = _tokenizer(run_dir), _eval_items(run_dir)
    eval_sha = dataset_sha256(run_dir / "data" / "eval.jsonl")
    assert cfg.teacher is not None
    if cfg.teacher.kind == "openai":
        from distillgates.eval.runners import TeacherRunner
        from distillgates.teacher.http import HTTPTeacher

        teacher: Any = TeacherRunner(HTTPTeacher(cfg.teacher, tokenizer), cfg.eval.max_new_tokens)
    else:  # a local teacher runs through the same engine and runner (identical weights via from_hf)
        teacher = TorchEngine(from_hf(_teacher(cfg, run_dir).model).eval())
    quality = {}
    for role, engine in (("student", TorchEngine(load_model(run_dir / "student" / "model.pt").eval())),
                         ("teacher", teacher)):
        quality[role] = evaluate(engine, items, tokenizer, lengths=cfg.shapes.lengths, dataset_sha256=eval_sha,
                                 max_calls=cfg.eval.max_calls, max_new_tokens=cfg.eval.max_new_tokens,
                                 constrained=role == "student" and cfg.eval.constrained_tool_calls, progress=True)
    spec = {"dataset": str(run_dir / "data" / "eval.jsonl"), "tokenizer": str(run_dir / "data" / "tokenizer"),
            "model": str(run_dir / "student" / "model.pt"), "runner": "engine",
            "max_new_tokens": cfg.eval.max_new_tokens, "max_calls": cfg.eval.max_calls,
            "constrained_tool_calls": cfg.eval.constrained_tool_calls}
    (run_dir / "eval" / "shards").mkdir(parents=True, exist_ok=True)
    determinism = sharded_determinism(spec, world_size=2, work_dir=run_dir / "eval" / "shards")
    atomic_write_json(run_dir / "eval" / "quality.json", quality)
    atomic_write_json(run_dir / "eval" / "determinism.json", determinism)
    student = quality["student"]
    return {key: student.get(key) for key in ("tool_selection", "json_validity", "f1_lax_macro", "privacy_ok_rate")}


def step_report(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from distillgates.eval import build_report, write_report
    from distillgates.hardware import hardware_header

    quality = json.loads((run_dir / "eval" / "quality.json").read_text())
    speed_report = json.loads((run_dir / "reports" / "speed.json").read_text())
    export_inputs = json.loads((run_dir / "export" / "gate_inputs.json").read_text())
    gate_inputs = {
        "determinism": json.loads((run_dir / "eval" / "determinism.json").read_text()),
        "qat": json.loads((run_dir / "student" / "qat_probe.json").read_text()),
        **export_inputs,
        "prompt_cache": speed_report["prompt_cache"],
        "teacher": json.loads((run_dir / "kd" / "build.json").read_text()),
    }
    if speed_report.get("speculative") is not None:
        gate_inputs["speculative"] = speed_report["speculative"]
    report = build_report(
        fingerprints=quality["student"]["fingerprints"],
        quality=quality,
        speed=speed_report["speed"],
        gate_inputs=gate_inputs,
        hardware=hardware_header(export_path=str(run_dir / "export")),
        config_sha256=cfg.fingerprint(),
        config=to_dict(cfg),
    )
    path = write_report(run_dir / "reports" / "report.json", report)
    return {"report": str(path)}


STEPS: list[Step] = [
    Step("data", "generate the toy dataset and train the tokenizer", ("data", "tokenizer", "shapes"), (), step_data,
         "data"),
    Step("teacher", "train the toy teacher (LlamaForCausalLM) and check it solves the task", ("teacher",),
         ("data",), step_teacher, "teacher"),
    Step("kd", "query the teacher for the training prompts and write the KD set", ("teacher",),
         ("data", "teacher"), step_kd, "kd", resumable=True),
    Step("student", "distill the student (KD + latency-aware losses, enumerated shapes, late QAT)",
         ("student", "train", "shapes"), ("data", "kd"), _train("student"), "student", resumable=True),
    Step("drafter", "distill the drafter for speculative decoding", ("drafter", "drafter_train", "train", "shapes"),
         ("data", "kd"), _train("drafter"), "drafter", resumable=True),
    Step("export", "export the student to Core ML (prefill + stateful decode), lint, parity",
         ("export", "shapes", "gates"), ("student",), step_export, "export"),
    Step("speed", "measure TTFT/TPS/TTFA, prompt cache and speculative decoding", ("speed",),
         ("student", "drafter"), step_speed),
    Step("eval", "evaluate student and teacher on held-out items; sharded determinism", ("shapes", "eval"),
         ("student", "teacher"), step_eval),
    Step("report", "write the validated report", (), ("eval", "speed", "export"), step_report),
]


# --------------------------------------------------------------------------------------
# CLI entry points (wired in cli.py)


def cli_run(args: argparse.Namespace) -> int:
    run_dir = run_pipeline(args.config, args.run_dir, args.force)
    return cli_report(argparse.Namespace(path=str(run_dir / "reports" / "report.json"), markdown=None))


def cli_step(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    set_threads(cfg)
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
    """``distillgates report``: validate a report.json, print it as a table (and write Markdown)."""
    from distillgates.eval.report import read_report, render_report, report_markdown
    from distillgates.io import atomic_write_text

    report = read_report(args.path)
    Console().print(render_report(report))
    if args.markdown:
        atomic_write_text(args.markdown, report_markdown(report))
    return 0


def cli_profile(args: argparse.Namespace) -> int:
    from distillgates import hardware

    profiles = hardware.load_profiles(args.profiles)
    detected = hardware.detect_hardware()
    matched = hardware.match_profile(detected, profiles)
    Console().print_json(
        data={
            "detected": to_dict(detected),
            "chip_family": detected.chip_family,
            "hardware_profile_key": hardware.profile_key(detected, profiles),
            "matched_profile": to_dict(matched) if matched else None,
        }
    )
    if args.hw_profile:
        hardware.select_profile(args.hw_profile, detected, allow_cross_hw=False, profiles=profiles)
    return 0
