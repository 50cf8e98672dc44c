"""The main job: data → teacher → KD set → student → drafter → export → speed → eval → report.

Every step is cached. Its fingerprint covers exactly what can change its output:

- the config fields it reads (``Step.config``, dotted paths, defaults included);
- the code it runs: the step function and the package modules it imports, transitively
  (:mod:`distillgates.codeversion`; docstrings and comments do not count);
- the checksums of the outputs of the steps it depends on (content, not their inputs: a
  re-run upstream that writes the same bytes leaves it cached);
- its environment (``Step.libraries``, ``Step.machine``): the installed versions of the libraries its
  output depends on (torch for training, eval and speed, coremltools for export, transformers and
  tokenizers for data, teacher and KD) and, for the export's figures and speed, the machine
  (:func:`machine_identity`): after an upgrade, or on another machine restoring a CI cache, old
  figures are never reused as current.

A re-run skips a step whose fingerprint is unchanged **and** whose outputs still have the
checksums recorded when it finished: a corrupted or hand-edited artifact is detected and the
step runs again, saying which file changed. ``--force`` redoes steps. The manifest
(``<run_dir>/manifest.json``) is written atomically after each step, so an interrupted run
resumes at the first unfinished step (training and the KD set continue from their checkpoints).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rich.console import Console

from distillgates.codeversion import step_code
from distillgates.config import Config, TrainConfig, load_config, sha256_json, to_dict
from distillgates.devices import resolve_device
from distillgates.hardware import peak_rss_bytes, reset_peak_rss
from distillgates.io import atomic_write_json, sha256_file
from distillgates.project import Project
from distillgates.rundir import RunDir

console = Console(stderr=True)

Outputs = Callable[[Config, RunDir], tuple[Path, ...]]


@dataclass(frozen=True)
class Step:
    name: str
    help: str
    config: tuple[str, ...]  # dotted config fields whose values change the step's output ("*": all of it)
    depends: tuple[str, ...]
    run: Callable[[Config, RunDir], dict[str, Any]]  # returns a small JSON summary
    outputs: Outputs  # what the step writes: checksummed in the manifest; folders in the run dir are cleared
    resumable: bool = False  # an interrupted run of the same inputs continues from its checkpoint
    # the step builds its outputs aside and swaps them in itself: a failed run keeps the previous ones
    replaces_outputs: bool = False
    files: Callable[[Config], tuple[Path, ...]] | None = None  # input files outside the run (content hashed)
    # values of other sections that change the output in some configs only (hashed when not empty, so the
    # other configs keep their fingerprints): the student's int4 QAT grid follows export.quantize
    derived: Callable[[Config], dict[str, Any]] | None = None
    libraries: tuple[str, ...] = ()  # distributions whose installed version changes the output
    machine: bool = False  # the output is a measurement of this machine (export figures, speed)

    @functools.cached_property
    def code(self) -> dict[str, str]:
        """``{module or module:function: sha256}`` of the code the step runs (:func:`codeversion.step_code`)."""
        return step_code(self.run.__module__, self.run.__name__)


# every Step.libraries name is one of these
LIBRARIES = ("torch", "coremltools", "transformers", "tokenizers", "trl", "peft", "coreai-torch", "coreai-core",
             "coreai-opt")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """``{distribution: installed version}`` (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


@functools.cache
def machine_identity() -> dict[str, Any]:
    """What a measurement on this machine depends on: system, architecture, SoC/CPU, OS (and its version), RAM
    and logical cores (:func:`distillgates.hardware.detect_hardware`)."""
    from distillgates.hardware import detect_hardware

    return dataclasses.asdict(detect_hardware())


def step_environment(step: Step) -> dict[str, Any]:
    """The environment part of ``step``'s inputs: its libraries' versions and, for a measurement, the machine."""
    env: dict[str, Any] = dict(library_versions(step.libraries))
    if step.machine:
        env["machine"] = machine_identity()
    return env


def environment_key() -> str:
    """A short digest of every library the steps depend on and this machine: the shipped CI workflows add it
    to their run-cache key, so no cache of another environment is restored (the steps' fingerprints cover
    it too)."""
    return sha256_json({"libraries": library_versions(), "machine": machine_identity()})[:16]


def config_value(cfg: Config, dotted: str) -> Any:
    """The JSON value of config field ``a.b.c`` (None below a missing optional section)."""
    if dotted == "*":
        return to_dict(cfg)
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part) if node is not None else None
    return to_dict(node)


def output_checksums(paths: tuple[Path, ...], run: RunDir) -> dict[str, str]:
    """``{path: sha256}`` of every file under ``paths`` (run-dir relative where inside it)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
    root = run.root.resolve()
    sums = {}
    for file in files:
        resolved = file.resolve()
        key = str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(resolved)
        sums[key] = sha256_file(file)
    return sums


class Pipeline:
    """Runs steps in order with fingerprint caching and a manifest."""

    def __init__(self, cfg: Config, run_dir: str | Path | RunDir, force: bool = False) -> None:
        self.cfg, self.force = cfg, force
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.manifest: dict[str, Any] = (
            json.loads(self.run_dir.manifest.read_text()) if self.run_dir.manifest.exists() else {}
        )

    def inputs(self, step: Step) -> dict[str, Any]:
        """Everything the step's output depends on (what its fingerprint hashes)."""
        upstream = {dep: sha256_json(self.manifest.get(dep, {}).get("outputs")) for dep in step.depends}
        config = {field: config_value(self.cfg, field) for field in step.config}
        config.update(step.derived(self.cfg) if step.derived else {})
        inputs = {"step": step.name, "config": config, "seed": self.cfg.seed, "code": step.code, "upstream": upstream}
        if files := (step.files(self.cfg) if step.files else ()):  # absent otherwise: the toy keeps its fingerprints
            inputs["files"] = {str(p): sha256_file(p) if Path(p).is_file() else None for p in files}
        if step.libraries or step.machine:
            inputs["env"] = step_environment(step)
        return inputs

    def fingerprint(self, step: Step) -> str:
        return sha256_json(self.inputs(step))

    def stale_reason(self, step: Step) -> str | None:
        """None when the cached result of ``step`` can be reused, else why not (config, code, upstream, outputs)."""
        entry = self.manifest.get(step.name)
        if not entry:
            return "not run yet"
        if entry.get("fingerprint") != self.fingerprint(step):
            before, current = entry.get("inputs", {}), self.inputs(step)
            changed = [f"{kind} {name}" for kind in ("config", "code", "upstream", "files", "env")
                       for name in sorted(set(before.get(kind, {})) | set(current.get(kind, {})))
                       if before.get(kind, {}).get(name) != current.get(kind, {}).get(name)]  # fmt: skip
            return "inputs changed: " + (", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "") or "seed")
        recorded = entry.get("outputs", {})
        current = output_checksums(step.outputs(self.cfg, self.run_dir), self.run_dir)
        for path in sorted(set(recorded) | set(current)):
            if recorded.get(path) != current.get(path):
                was, now = recorded.get(path) or "none", current.get(path) or "missing"
                return f"{path} changed since the step wrote it (sha256 {was[:12]} -> {now[:12]})"
        return None

    def is_fresh(self, step: Step) -> bool:
        return self.stale_reason(step) is None

    def adopt(self, base: RunDir) -> list[str]:
        """Copy into this run, in step order, every step not run here that is fresh in ``base`` (another run
        directory) under this config: same fingerprint (config, seed, code, upstream outputs), outputs unchanged
        there. Returns the steps taken; the first step whose inputs differ (and all that depend on it) is left
        to run."""
        other, root, adopted = Pipeline(self.cfg, base), base.root.resolve(), []
        for step in STEPS:
            entry = other.manifest.get(step.name)
            if step.name in self.manifest or not entry or entry.get("fingerprint") != self.fingerprint(step) \
                    or other.stale_reason(step) is not None:  # fmt: skip
                continue
            for out in step.outputs(self.cfg, base):
                if out.exists() and out.resolve().is_relative_to(root):  # a given checkpoint outside stays where it is
                    target = self.run_dir.root / out.resolve().relative_to(root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if out.is_dir():
                        shutil.copytree(out, target, dirs_exist_ok=True)
                    else:
                        shutil.copy2(out, target)
            self.manifest[step.name] = entry
            atomic_write_json(self.run_dir.manifest, self.manifest)
            adopted.append(step.name)
        return adopted

    def run_step(self, step: Step, force: bool | None = None) -> dict[str, Any]:
        force = self.force if force is None else force
        reason = "--force" if force else self.stale_reason(step)
        if reason is None:
            console.print(f"[dim]✓ {step.name}: cached ({self.manifest[step.name]['seconds']:.1f}s before)[/dim]")
            return self.manifest[step.name]["summary"]
        console.rule(f"[bold]{step.name}[/bold] — {step.help}")
        if reason != "not run yet":
            console.print(f"[dim]running {step.name}: {reason}[/dim]")
        self._prepare_output(step, force)
        reset_peak_rss()
        started = time.perf_counter()
        summary = step.run(self.cfg, self.run_dir)
        seconds = time.perf_counter() - started
        peak = peak_rss_bytes()
        self.manifest[step.name] = {
            "fingerprint": self.fingerprint(step),
            "inputs": self.inputs(step),
            "outputs": output_checksums(step.outputs(self.cfg, self.run_dir), self.run_dir),
            "seconds": round(seconds, 2),
            "peak_rss_bytes": peak,
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "summary": summary,
        }
        atomic_write_json(self.run_dir.manifest, self.manifest)
        console.print(f"[green]✓ {step.name}[/green] in {seconds:.1f}s, peak RSS {peak / 2**30:.2f} GiB")
        return summary

    def _prepare_output(self, step: Step, force: bool) -> None:
        """Clear the step's outputs in the run dir; a resumable step keeps its folder only when the
        interrupted attempt had the same inputs."""
        fingerprint = self.fingerprint(step)
        started = self.manifest.get("_started", {}).get(step.name)
        keep = step.resumable and not force and started == fingerprint
        root = self.run_dir.root.resolve()
        for out in step.outputs(self.cfg, self.run_dir):
            if keep or step.replaces_outputs or not out.resolve().is_relative_to(root):  # never outside the run dir
                continue
            if out.is_dir():
                shutil.rmtree(out)
            elif out.exists():
                out.unlink()
        self.manifest.pop(step.name, None)  # a half-written output is never "cached"
        self.manifest.setdefault("_started", {})[step.name] = fingerprint
        atomic_write_json(self.run_dir.manifest, self.manifest)

    def run(self, names: list[str] | None = None) -> dict[str, Any]:
        for step in STEPS:
            if names is None or step.name in names:
                missing = [d for d in step.depends if d not in self.manifest and (names and d not in names)]
                if missing:
                    raise FileNotFoundError(
                        f"step {step.name!r} needs {', '.join(missing)} first: run `distillgates "
                        f"{missing[0]} ...` or `distillgates run ...` with the same --run-dir ({self.run_dir.root})"
                    )
                self.run_step(step)
        return self.manifest


def set_threads(cfg: Config) -> None:
    import torch

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)


def default_run_dir(cfg: Config, seed: int | None = None, student_seed: int | None = None) -> Path:
    """``runs/<name>`` in the project of the working directory (:meth:`Project.find`: the nearest folder at or
    above it with ``distillgates.yaml``, ``pyproject.toml`` or ``.git``), where the gates look for it;
    ``runs/<name>-seed<N>`` for a run whose seed ``--seed`` set, ``...-student-seed<M>`` when ``--student-seed`` set
    the student's."""
    name = cfg.name + (f"-seed{seed}" if seed is not None else "")
    name += f"-student-seed{student_seed}" if student_seed is not None else ""
    return Project.find(Path.cwd()).runs_dir / name


def load_run(config_path: str | Path, run_dir: str | Path | None = None, seed: int | None = None,
             student_seed: int | None = None) -> tuple[Config, Path]:
    """The pipeline config and its run directory (``run_dir``, else :func:`default_run_dir`).

    ``seed`` (``--seed``) replaces the config's top-level ``seed`` (the toy teacher's) and the ``train.seed`` of the
    student and drafter: their initialisation and batch order. ``data.seed``, and with it the dataset and the eval
    set, stays, so a build of another seed is gated against the same drift baselines (a stand-in for another
    machine: docs/benchmarks.md, section 11). ``student_seed`` (``--student-seed``) replaces only the student's and
    drafter's ``seed``: another student of the same teacher and KD set (:func:`run_pipeline` reuses them)."""
    cfg = load_config(config_path)
    for value, top_level in ((seed, True), (student_seed, False)):
        if value is not None:
            drafter_train = cfg.drafter_train and dataclasses.replace(cfg.drafter_train, seed=value)
            cfg = dataclasses.replace(cfg, seed=value if top_level else cfg.seed,
                                      train=dataclasses.replace(cfg.train, seed=value), drafter_train=drafter_train)
    return cfg, Path(run_dir) if run_dir else default_run_dir(cfg, seed, student_seed)


def reuse_base_run(pipeline: Pipeline, seed: int | None, student_seed: int | None) -> None:
    """``--student-seed``: take the steps the student's seed leaves alone (data, teacher, check, KD set) from the run
    without it (``runs/<name>`` or ``runs/<name>-seed<N>``) where they are fresh there (:meth:`Pipeline.adopt`)."""
    if student_seed is None:
        return
    base = default_run_dir(pipeline.cfg, seed)
    fresh = base.resolve() != pipeline.run_dir.root.resolve() and (base / "manifest.json").is_file()
    if fresh and (adopted := pipeline.adopt(RunDir(base))):
        console.print(f"[dim]reused from {base}: {', '.join(adopted)}[/dim]")


def run_pipeline(config_path: str | Path, run_dir: str | Path | None = None, force: bool = False,
                 seed: int | None = None, student_seed: int | None = None) -> Path:
    """Run the whole pipeline (``seed``, ``student_seed``: :func:`load_run`); returns the run directory
    (``reports/report.json`` inside)."""
    cfg, run_dir = load_run(config_path, run_dir, seed, student_seed)
    set_threads(cfg)
    started = time.perf_counter()
    preflight(cfg)
    pipeline = Pipeline(cfg, run_dir, force)
    reuse_base_run(pipeline, seed, student_seed)
    pipeline.run()
    console.print(f"[bold]pipeline finished in {time.perf_counter() - started:.0f}s[/bold] → {run_dir}")
    return run_dir


def preflight(cfg: Config) -> None:
    """Check what the steps need that the config alone decides, before the first step runs (an error after
    minutes of earlier steps is one found too late): the student's chat template writes tool calls its parser
    reads back, a local teacher's checkpoint exists, and a pretrained student's or drafter's checkpoint
    (``init_from: hf:``/``gguf:``) has the run's vocabulary and the architecture its section states.
    (A model trained from the teacher inherits what it must share when the config loads:
    :func:`distillgates.config.inherit_teacher_fields`.)

    Raises:
        ValueError / FileNotFoundError: naming the setting.
    """
    from distillgates.checkpoints import checkpoint_dir
    from distillgates.data.build import student_tokenizer
    from distillgates.data.chat import chat_format, template_chat_format

    tokenizer = None
    try:
        if cfg.tokenizer.path is not None:
            tokenizer = student_tokenizer(cfg, [])
            chat_format(tokenizer)
        else:
            template_chat_format(cfg.tokenizer.chat_template or "toy")
    except ValueError as err:
        raise ValueError(f"tokenizer: {err}") from err
    if cfg.teacher is not None and cfg.teacher.kind == "local" and cfg.teacher.path:
        folder = checkpoint_dir(cfg.teacher.path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"teacher.path: no checkpoint at {cfg.teacher.path} (config.json or a .gguf file)")
        if cfg.teacher.finetune is not None and not all(find_spec(name) for name in ("trl", "peft")):
            raise ImportError("teacher.finetune needs TRL and peft: pip install 'distillgates[finetune]'")
    try:
        resolve_device(cfg.device)
    except ValueError as err:
        raise ValueError(f"device: {err}") from err
    features = cfg.student.gemma_features() if cfg.student is not None else []
    if features and cfg.export.layout == "ane":
        raise ValueError(f"export.layout: ane does not compute Gemma 3's {', '.join(features)} (the student's): use "
                         "layout: standard")  # fmt: skip
    for role, train in (("student", cfg.train), ("drafter", cfg.drafter_train or cfg.train)):
        if train.pretrained is None or (role == "drafter" and cfg.drafter is None):
            continue
        from transformers import AutoConfig

        from distillgates.hf import model_config_from_hf
        from distillgates.train.init import check_section, check_vocabulary

        where = f"{'drafter_train' if role == 'drafter' and cfg.drafter_train else 'train'}.init_from " \
                f"{train.init_from!r}"  # fmt: skip
        folder = checkpoint_dir(train.pretrained)
        if tokenizer is None:
            raise ValueError(f"{where}: needs tokenizer.path (the checkpoint's tokenizer: token ids must mean the same "
                             "tokens), not a tokenizer the data step trains")  # fmt: skip
        check_vocabulary(folder, tokenizer, where)
        section = getattr(cfg, role)
        if section is not None:
            checkpoint = model_config_from_hf(AutoConfig.from_pretrained(folder, local_files_only=True),
                                              section.max_seq_len)  # fmt: skip
            check_section(section, checkpoint, f"{role}: {where}")


# --------------------------------------------------------------------------------------
# Steps


def step_data(cfg: Config, run: RunDir) -> dict[str, Any]:
    from distillgates.data.build import SKIPPED_ROWS, build_data

    built = build_data(cfg, run.data_dir)
    summary: dict[str, Any] = {
        "tokenizer_fingerprint": built.tokenizer_fingerprint,
        "dataset_sha256": built.dataset_sha256,
        "dropped": {split: len(ids) for split, ids in built.dropped.items()},
        "shape_counts": {split: {str(k): v for k, v in c.items()} for split, c in built.shape_counts.items()},
    }
    if built.skipped is not None:  # data.invalid_rows: skip
        summary["skipped_rows"] = len(built.skipped)
        console.print(f"data: skipped {len(built.skipped)} invalid rows (listed in {run.data_dir / SKIPPED_ROWS})")
    return summary


def step_teacher(cfg: Config, run: RunDir) -> dict[str, Any]:
    if cfg.teacher is None:
        raise ValueError("config has no teacher section")
    if cfg.teacher.kind == "openai":
        return {"kind": "openai", "base_url": cfg.teacher.api.base_url, "model": cfg.teacher.api.model_name}
    summary: dict[str, Any] = {"kind": "local"}
    if cfg.teacher.finetune is not None:  # teacher.path fine-tuned on the training rows into the run's teacher/
        from distillgates.checkpoints import checkpoint_dir
        from distillgates.teacher.finetune import finetune_teacher

        summary["path"] = cfg.teacher.path
        summary["finetune"] = finetune_teacher(cfg, checkpoint_dir(str(cfg.teacher.path)), run.tokenizer(),
                                               run.items("train"), run.teacher_dir)  # fmt: skip
    elif cfg.teacher.path:  # a given AutoModelForCausalLM directory: nothing to train (its files are checksummed)
        summary["path"] = cfg.teacher.path
    else:
        from distillgates.teacher.toy import train_toy_teacher

        stats = train_toy_teacher(cfg, run.tokenizer(), run.items("train"), run.teacher_dir, seed=cfg.seed)
        summary.update({key: stats[key] for key in ("steps", "final_loss", "n_params")})
    return summary  # its full quality is measured once, by the eval step; whether it calls tools, by the check step


def step_check(cfg: Config, run: RunDir) -> dict[str, Any]:
    from distillgates.eval.evaluate import check_eval_budget
    from distillgates.teacher.check import check_teacher

    # the eval's budget against every held-out reference: before KD and training (the eval step checks it again)
    check_eval_budget(run.items("eval"), run.tokenizer(), cfg.eval.max_new_tokens, cfg.eval.max_calls)
    return check_teacher(cfg, run)


def step_kd(cfg: Config, run: RunDir) -> dict[str, Any]:
    from distillgates.teacher.kd import build_kd_set

    assert cfg.teacher is not None
    if cfg.teacher.kind == "openai":
        from distillgates.teacher.http import HTTPTeacher

        teacher: Any = HTTPTeacher(cfg.teacher.api, run.tokenizer())
    else:
        from distillgates.teacher.local import local_teacher

        # on the student's tokens
        teacher = local_teacher(run.teacher_model_dir(cfg), run.tokenizer(), cfg.teacher.chat_template,
                                resolve_device(cfg.device))
    # resume is safe: the builder refuses a checkpoint of another build (different teacher/items); the
    # response cache lives outside kd/ so it survives a config change (keys are request hashes)
    result = build_kd_set(cfg, teacher, run.items("train"), run.kd_set, resume=True, cache_dir=run.kd_cache)
    if not result.complete:
        raise RuntimeError(f"KD set incomplete: {result.message}")
    # gate_inputs.teacher: an API teacher's KD set is reproducible only in determinism mode with no retry
    atomic_write_json(run.kd_build, {
        "kind": cfg.teacher.kind, "determinism": cfg.teacher.api.determinism, "retries": result.retries,
        "cache_hits": result.cache_hits, "records": result.n_done, "tokens": result.spent_tokens,
        "kd_positions": result.positions, "kd_coverage": round(result.coverage, 6),
    })
    return {"records": result.n_done, "tokens": result.spent_tokens, "status": result.status}


def scoring_teacher(cfg: Config, run: RunDir, role: str) -> Any:
    """The run's local teacher where it scores the role's batches (``teacher_mode: online``, on-policy), else None."""
    train_cfg = cfg.train_section(role)
    if train_cfg.teacher_mode != "online" and train_cfg.on_policy.share <= 0:
        return None
    from distillgates.teacher.local import LocalTeacher

    return LocalTeacher(run.teacher_model_dir(cfg), device=resolve_device(cfg.device))


def train_role(cfg: Config, run: RunDir, role: str) -> dict[str, Any]:
    from distillgates.train.recipe import train_student

    path = train_student(cfg, role, run, teacher=scoring_teacher(cfg, run, role), device=cfg.device)
    summary: dict[str, Any] = {"model": str(path)}
    probe = run.optional_json(run.qat_probe(role))
    if probe is not None:
        summary["qat_probe_cosine_min"] = probe.get("probe_cosine_min")
    return summary


def _student_qat_grid(cfg: Config) -> dict[str, Any]:
    """The student's int4 QAT block (``export.int4_block_size``) when QAT trains int4; empty for int8."""
    block = cfg.student_qat_int4_block if cfg.train.qat.enabled else None
    return {"qat_int4_block": block} if block is not None else {}


def step_student(cfg: Config, run: RunDir) -> dict[str, Any]:
    return train_role(cfg, run, "student")


def step_drafter(cfg: Config, run: RunDir) -> dict[str, Any]:
    return train_role(cfg, run, "drafter")


def step_export(cfg: Config, run: RunDir) -> dict[str, Any]:
    import torch

    from distillgates.data.targets import encode_item
    from distillgates.export.api import export_model
    from distillgates.tokenizer import tokenizer_fingerprint

    # the first training rows (the data step is upstream: fingerprinted): the fp16 headroom scan, and int4
    # clip_search's calibration where configured
    tok = run.tokenizer()
    items = run.items("train")[: cfg.export.calibration_rows]
    calibration = [torch.tensor([encode_item(tok, item).input_ids]) for item in items]  # (1, T) conversations
    result = export_model(run.model_path(), cfg, run.export_dir, tokenizer_fingerprint(run.tokenizer()),
                          calibration=calibration)  # fmt: skip
    atomic_write_json(run.export_gate_inputs, result.gate_inputs)
    return {
        "packages": {name: str(path) for name, path in result.packages.items()},
        # a lint figure, not residency (none with target coreai: the lint reads the Core ML package)
        "ane_op_eligible_share": result.gate_inputs["ane_lint"].get("op_eligible_share"),
        "cosine_by_shape": result.gate_inputs["export"]["cosine_by_shape"],
        "fp16_max_activation": result.headroom.get("max_peak"),
    }


def step_speed(cfg: Config, run: RunDir) -> dict[str, Any]:
    """The student's TTFT/TPS/TTFA (the Core ML export with ``speed.engine: coreml``, the Core AI asset with
    ``coreai``: macOS), the prompt cache and
    speculative decoding (when a drafter exists), written to ``reports/speed.json``.

    The timed figures are measured as the speed gates measure, in speed worker processes
    (:mod:`distillgates.gates.speed_ab`), never in this process (whose thread count, load and earlier steps
    made its TPS 6x lower than the workers' at SmolLM2-135M): the ``speed`` section in one fresh worker, the
    speculative speedup in ``speed.speculative_workers`` fresh workers, each decoding plainly and speculatively
    interleaved. In this process: the prompt cache (one thread, alternating pairs) and the untimed speculative
    figures (identical output, acceptance)."""
    import dataclasses

    from distillgates.data.chat import chat_format
    from distillgates.gates.speed_ab import report_speed, speculative_speedup
    from distillgates.gates.stats import compare_speedup
    from distillgates.hardware import hardware_header
    from distillgates.runtime.prompt_cache import prefix_until
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.speed import measure_prompt_cache, measure_speculative, speed_report, write_report

    backend, tokenizer = cfg.speed.engine, run.tokenizer()
    fmt = chat_format(tokenizer)
    prompts = [fmt.prompt(item) for item in run.items("eval")]
    stop_ids = tuple(fmt.stop_ids)
    export_dir = run.export_dir if backend != "torch" else None
    hardware = hardware_header(backend, export_dir)
    speed = report_speed(run, dataclasses.asdict(cfg.speed), export_dir, cfg.shapes.lengths, backend)
    torch_engine = TorchEngine(run.load_model())
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[: cfg.speed.n_prompts]]
    # milliseconds a sample: 10+ rounds steady the medians the gate compares
    repeats = max(cfg.speed.repeats, 10)
    prompt_cache = measure_prompt_cache(torch_engine, ids, prefix_until(stop_ids[0]), repeats=repeats)
    speculative = None
    if run.has_model("drafter"):
        items = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[: cfg.speed.speculative_items]]
        speculative = measure_speculative(torch_engine, TorchEngine(run.load_model("drafter")), items,
                                          max_new_tokens=cfg.speed.max_new_tokens, stop_ids=stop_ids)
        tps = speculative_speedup(run, workers=cfg.speed.speculative_workers, samples=cfg.speed.speculative_samples)
        interval = compare_speedup(tps["tps_plain"], tps["tps_speculative"], minimum=1.0)  # the gate decides
        speculative.update(tps, speedup=interval.speedup, speedup_ci=[interval.ci_low, interval.ci_high],
                           speedup_ci_level=1 - 2 * interval.test_alpha)
    report = speed_report(hardware, speed, prompt_cache, speculative)
    write_report(run.speed_report, report)
    speed = report["speed"]
    return {"ttft_ms_p50": speed["ttft_ms"]["p50"], "tps_p50": speed["tps"]["p50"], "backend": speed["backend"],
            **({"speculative_speedup": speculative["speedup"]} if speculative else {})}


def step_eval(cfg: Config, run: RunDir) -> dict[str, Any]:
    """Student and teacher on the held-out items, each evaluated once; the student's outputs are also
    the unsharded arm of the determinism check (the shards re-run it, on the same thread count)."""
    from distillgates.data.dataset import drawn_items
    from distillgates.data.fingerprints import dataset_sha256
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import check_eval_budget, evaluate, sharded_determinism
    from distillgates.eval.scorer import item_rows, summarize
    from distillgates.eval.sharding import outputs_sha256, write_outputs
    from distillgates.hardware import torch_threads
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.teacher.check import teacher_runner

    tokenizer, items = run.tokenizer(), run.items("eval")
    check_eval_budget(items, tokenizer, cfg.eval.max_new_tokens, cfg.eval.max_calls)  # as the check step did
    drawn = drawn_items(items)  # the figures' items; data.eval_min_per_shape's top-up only powers the drift gates
    eval_sha = dataset_sha256(run.dataset("eval"))
    teacher = teacher_runner(cfg, run, tokenizer)
    policy = FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result)
    common: dict[str, Any] = {"lengths": cfg.shapes.lengths, "dataset_sha256": eval_sha, "progress": True,
                              "max_calls": cfg.eval.max_calls, "max_new_tokens": cfg.eval.max_new_tokens,
                              "policy": policy, "privacy": cfg.eval.privacy}
    with torch_threads(cfg.eval.threads):  # the shard workers' thread count: the same kernels, bit for bit
        batch = cfg.eval.batch_size  # items decoded together (the engine's cache rows)
        student, outputs, scores = evaluate(TorchEngine(run.load_model(), max_batch_size=batch), items, tokenizer,
                                            return_outputs=True, batch_size=batch,
                                            constrained=cfg.eval.constrained_tool_calls, **common)  # fmt: skip
    if len(drawn) < len(items):
        student = {**summarize([s for s in scores if not s.top_up]), "fingerprints": student["fingerprints"]}
    student["outputs_sha256"] = outputs_sha256(outputs)  # the determinism gate checks the shards compared these
    quality = {"student": student, "teacher": evaluate(teacher, drawn, tokenizer, **common)}
    write_outputs(run.eval_outputs, outputs)
    # per-item F1 of the student for the paired drift gates (kept out of report.json: one row per item)
    atomic_write_json(run.item_scores, {"role": "student", "items": item_rows(scores)})
    spec = {"dataset": str(run.dataset("eval")), "tokenizer": str(run.tokenizer_dir), "model": str(run.model_path()),
            "runner": "engine", "max_new_tokens": cfg.eval.max_new_tokens, "max_calls": cfg.eval.max_calls,
            "constrained_tool_calls": cfg.eval.constrained_tool_calls, "threads": cfg.eval.threads,
            "batch_size": cfg.eval.batch_size,
            "missing_fixture": cfg.eval.missing_fixture, "mock_result": cfg.eval.mock_result}
    run.shards_dir.mkdir(parents=True, exist_ok=True)
    determinism = sharded_determinism(spec, world_size=2, work_dir=run.shards_dir, unsharded=outputs)
    atomic_write_json(run.quality, quality)
    atomic_write_json(run.determinism, determinism)
    return {key: student.get(key) for key in ("tool_selection", "json_validity", "f1_lax_macro", "privacy_ok_rate")}


def coreai_eval_path(run: RunDir) -> Path:
    """What the coreai_eval step writes: the outputs of the items it decoded and their comparison."""
    return run.root / "coreai" / "eval.json"


def step_coreai_eval(cfg: Config, run: RunDir) -> dict[str, Any]:
    """``export.coreai_eval_items`` drawn eval items (a seeded random sample) decoded greedily through
    ``export/model.aimodel`` (Core AI's runtime, in ``export.coreai_eval_workers`` worker processes side by side: what
    ships), scored, and compared output by output with the PyTorch engine's outputs of the eval step; the coreai
    quality gates correct the eval's figures by the per-item scores' differences from PyTorch's. ``{"skipped":
    reason}`` when there is no asset (target coreml, no coreai extra)."""
    from concurrent.futures import ThreadPoolExecutor

    from distillgates.data.dataset import drawn_items
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.runners import EngineRunner
    from distillgates.eval.scorer import ItemScore, item_rows, summarize
    from distillgates.eval.sharding import read_outputs
    from distillgates.export.functions import COREAI_SOURCE
    from distillgates.runtime.coreai_engine import open_engine

    path = coreai_eval_path(run)
    contract = run.read_json(run.contract)
    section = contract.get("coreai", {"skipped": "export.target coreml: no Core AI asset"})
    if "skipped" in section or cfg.export.coreai_eval_items == 0:
        measured = {"skipped": section.get("skipped", "export.coreai_eval_items is 0")}
        atomic_write_json(path, measured)
        return measured
    run.verify_packages()  # the asset the export wrote and measured
    tokenizer = run.tokenizer()
    drawn = drawn_items(run.items("eval"))
    # a seeded random sample in eval order: the coreai gates correct the eval's figures by it (an eval file given in
    # some order, e.g. by tool, would bias a prefix)
    keep = set(random.Random(cfg.seed).sample(range(len(drawn)), min(cfg.export.coreai_eval_items, len(drawn))))
    items = [item for i, item in enumerate(drawn) if i in keep]
    pytorch = {o["id"]: o for o in read_outputs(run.eval_outputs)}

    def decode(shard: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ItemScore]]:
        """One runtime worker process decodes and scores ``shard`` (items are independent, decoding greedy)."""
        engine, worker = open_engine(run.export_dir)
        with worker:
            runner = EngineRunner(engine, tokenizer, contract["model_fingerprint"],
                                  cfg.eval.max_new_tokens, cfg.eval.constrained_tool_calls)  # fmt: skip
            _, outputs, scores = evaluate(runner, shard, tokenizer, return_outputs=True, lengths=cfg.shapes.lengths,
                                          max_calls=cfg.eval.max_calls, max_new_tokens=cfg.eval.max_new_tokens,
                                          policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result),
                                          privacy=cfg.eval.privacy)  # fmt: skip
        return outputs, scores

    # the Linux runtime computes on one thread: its worker processes decode interleaved shards side by side
    workers = min(cfg.export.coreai_eval_workers, len(items))
    shards = [items[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(len(shards)) as pool:
        decoded = list(pool.map(decode, shards))
    order = {item["id"]: i for i, item in enumerate(items)}
    pairs = sorted(((o, s) for outputs, scores in decoded for o, s in zip(outputs, scores, strict=True)),
                   key=lambda pair: order[pair[0]["id"]])
    outputs, scores = [o for o, _ in pairs], [s for _, s in pairs]
    figures = summarize(scores)
    differing = [o["id"] for o in outputs if o != pytorch.get(o["id"])]
    keys = ("f1_lax_macro", "tool_selection", "json_validity", "fixture_hit_rate")
    measured = {"source": COREAI_SOURCE.split(" vs ")[0], "items": len(outputs),
                "identical": len(outputs) - len(differing), "differing_ids": differing,
                "student": {k: figures.get(k) for k in keys}, "item_scores": item_rows(scores), "outputs": outputs}
    atomic_write_json(path, measured)
    return {k: measured[k] for k in ("items", "identical")}


def step_report(cfg: Config, run: RunDir) -> dict[str, Any]:
    from distillgates.eval.report import build_report, write_report

    quality = run.read_json(run.quality)
    speed_report = run.read_json(run.speed_report)
    gate_inputs = {
        "determinism": run.read_json(run.determinism),
        **run.read_json(run.export_gate_inputs),
        "prompt_cache": speed_report["prompt_cache"],
        "teacher": run.read_json(run.kd_build),
    }
    coreai_eval = run.optional_json(coreai_eval_path(run))  # absent in a run built before the step
    if coreai_eval is not None:
        gate_inputs["coreai_eval"] = {k: v for k, v in coreai_eval.items() if k != "outputs"}
    qat = run.optional_json(run.qat_probe())  # absent when train.qat.enabled is off
    if qat is not None:
        gate_inputs["qat"] = qat
    if speed_report.get("speculative") is not None:
        gate_inputs["speculative"] = speed_report["speculative"]
    report = build_report(
        fingerprints=quality["student"]["fingerprints"],
        quality=quality,
        speed=speed_report["speed"],
        gate_inputs=gate_inputs,
        hardware=speed_report["hardware"],  # the machine and engine that timed the speed figures
        config_sha256=cfg.fingerprint(),
        config=to_dict(cfg),
    )
    path = write_report(run.report, report)
    return {"report": str(path)}


def _data_files(cfg: Config) -> tuple[Path, ...]:
    from distillgates.data.build import input_files

    return input_files(cfg)


def _checkpoint_files(train: TrainConfig | None) -> tuple[Path, ...]:
    """The files of an ``init_from: hf:<dir>`` checkpoint (or the ``gguf:<file>``): a checkpoint replaced in place
    re-trains."""
    path = train.pretrained if train is not None else None
    if path is None or not path.exists():
        return ()
    return (path,) if path.is_file() else tuple(sorted(p for p in path.rglob("*") if p.is_file()))


def _teacher_outputs(cfg: Config, run: RunDir) -> tuple[Path, ...]:
    if cfg.teacher is not None and cfg.teacher.kind == "openai":
        return ()
    # a given teacher.path is checksummed too (never cleared): a changed model there re-runs KD
    return (run.teacher_model_dir(cfg),)


STEPS: list[Step] = [
    Step("data", "generate the toy dataset (or read your own) and train the tokenizer", ("data", "tokenizer", "shapes"),
         (), step_data, lambda cfg, run: (run.data_dir,), replaces_outputs=True, files=_data_files,
         libraries=("tokenizers", "transformers")),
    Step("teacher", "train the toy teacher, or fine-tune teacher.path on the training rows",
         ("teacher.kind", "teacher.path", "teacher.model", "teacher.train", "teacher.finetune",
          "teacher.chat_template"), ("data",), step_teacher, _teacher_outputs,
         libraries=("torch", "transformers", "tokenizers", "trl", "peft")),
    Step("check", "the local teacher answers held-out tool items; one that calls no tool is refused before KD",
         ("teacher.kind", "teacher.chat_template", "teacher.check", "eval.max_new_tokens", "eval.max_calls",
          "eval.missing_fixture", "eval.mock_result", "eval.privacy"), ("data", "teacher"), step_check,
         lambda cfg, run: (run.teacher_check,), libraries=("torch", "transformers", "tokenizers")),
    Step("kd", "query the teacher for the training prompts and write the KD set",
         ("teacher.kind", "teacher.api", "teacher.chat_template", "kd"), ("data", "teacher", "check"), step_kd,
         lambda cfg, run: (run.kd_dir,), resumable=True, libraries=("torch", "transformers", "tokenizers")),
    Step("student", "distill the student (KD + latency-aware losses, enumerated shapes, late QAT)",
         ("student", "train", "shapes", "speed.n_prompts"), ("data", "teacher", "kd"), step_student,
         lambda cfg, run: (run.model_dir("student"),), resumable=True, files=lambda cfg: _checkpoint_files(cfg.train),
         libraries=("torch", "tokenizers"), derived=_student_qat_grid),
    Step("drafter", "distill the drafter for speculative decoding",
         ("drafter", "drafter_train", "train", "shapes", "speed.n_prompts"), ("data", "teacher", "kd"), step_drafter,
         lambda cfg, run: (run.model_dir("drafter"),), resumable=True,
         files=lambda cfg: _checkpoint_files(cfg.drafter_train or cfg.train), libraries=("torch", "tokenizers")),
    Step("export", "export the student (prefill_<L> + stateful decode) to a Core ML package and/or a Core AI asset "
         "(export.target), lint, parity",
         ("export", "shapes", "gates"), ("data", "student"), step_export, lambda cfg, run: (run.export_dir,),
         libraries=("torch", "coremltools", "coreai-torch", "coreai-core", "coreai-opt"), machine=True),
    Step("speed", "measure TTFT/TPS/TTFA, prompt cache and speculative decoding", ("speed",),
         ("data", "student", "drafter"), step_speed, lambda cfg, run: (run.speed_report,),
         libraries=("torch", "coremltools", "tokenizers"), machine=True),
    Step("eval", "evaluate student and teacher on held-out items; sharded determinism",
         ("shapes", "eval", "teacher.kind", "teacher.api", "teacher.chat_template"), ("data", "teacher", "student"),
         step_eval, lambda cfg, run: (run.eval_dir,), libraries=("torch", "transformers", "tokenizers")),
    Step("coreai_eval", "decode eval items through export/model.aimodel (Core AI's runtime) and compare with PyTorch",
         ("export", "eval", "shapes"), ("data", "export", "eval"), step_coreai_eval,
         lambda cfg, run: (coreai_eval_path(run),), libraries=("coreai-core",)),
    Step("report", "write the validated report", ("*",), ("eval", "speed", "export", "kd", "student", "coreai_eval"),
         step_report,
         lambda cfg, run: (run.report,)),
]


# --------------------------------------------------------------------------------------
# CLI entry points (wired in cli.py)


def cli_run(args: argparse.Namespace) -> int:
    run_dir = run_pipeline(args.config, args.run_dir, args.force, args.seed, args.student_seed)
    return cli_report(argparse.Namespace(path=str(run_dir / "reports" / "report.json"), markdown=None))


def cli_step(args: argparse.Namespace) -> int:
    cfg, run_dir = load_run(args.config, args.run_dir, args.seed, args.student_seed)
    set_threads(cfg)
    pipeline = Pipeline(cfg, run_dir, args.force)
    reuse_base_run(pipeline, args.seed, args.student_seed)
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
