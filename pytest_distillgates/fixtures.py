"""The gates' fixtures: thresholds, enumerated shapes, the run report, speed samplers.

Registered by the plugin (``pytest_plugins`` in :mod:`pytest_distillgates.plugin`), so the shipped
checklist and a project's own gate tests use the same fixtures; a project's ``conftest.py`` may
override any of them. The plugin itself provides ``gate``, ``pipeline_run``, ``hardware_profile``
and ``baseline_store``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distillgates.config import GatesConfig, SpeedConfig, load_config
from distillgates.gates import BaselineEntry
from distillgates.gates.session import GateSession, RunArtifacts
from distillgates.gates.stats import Interval, mean_interval, wilson_interval
from distillgates.hardware import GatingPolicy, load_profiles
from distillgates.io import sha256_file
from pytest_distillgates.checklist import CHECKLIST_DIR
from pytest_distillgates.plugin import SESSION_KEY


def _shapes(config: pytest.Config) -> list[str]:
    """Enumerated shapes to parametrize over: the run's config (``header.config.shapes.lengths`` of its
    report), else the project's pipeline config's lengths. Never the report's shape slices: a shape with
    no eval items has no slice, and must fail its shape gates rather than go ungated."""
    run_dir = config.getoption("dg_run_dir")
    if run_dir is not None:
        return [str(n) for n in RunArtifacts(run_dir).get("header.config.shapes.lengths")]
    return [str(n) for n in load_config(config.stash[SESSION_KEY].project.config_path).shapes.lengths]


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every gate of the checklist is an integration test: it needs the pipeline run (the toy's takes ~10 min
    to build on 2 cores), so ``-m "not integration"`` deselects the checklist before anything builds it."""
    for item in items:
        if item.path.is_relative_to(CHECKLIST_DIR):
            item.add_marker(pytest.mark.integration)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "shape" in metafunc.fixturenames:
        metafunc.parametrize("shape", _shapes(metafunc.config))


@pytest.fixture(scope="session")
def thresholds(gate_session: GateSession) -> GatesConfig:
    """The gate thresholds: the embedded ones, each key the project's thresholds file sets replaced; which
    file each came from is recorded in the gate report, the summary and the terminal table."""
    return gate_session.thresholds()


@pytest.fixture(scope="session")
def speed_policy(hardware_profile: str, thresholds: GatesConfig, gate_session: GateSession) -> GatingPolicy:
    """The speed gating policy of the selected hardware profile (the project's hardware profiles, else the
    embedded ones): its ``max_regression`` is the gate threshold and every measurement round takes at least
    its ``min_samples``. A machine without a profile (a generated key) uses ``gates.speed_regression_max``."""
    profiles = {p.key: p for p in load_profiles(gate_session.project.hardware_profiles_path)}
    if hardware_profile not in profiles:
        return GatingPolicy(max_regression=thresholds.speed_regression_max, min_samples=2)
    policy = profiles[hardware_profile].gating
    speed = gate_session.context.speed
    speed.samples = max(speed.samples, policy.min_samples)
    return policy


@pytest.fixture(scope="session")
def report(pipeline_run: RunArtifacts) -> RunArtifacts:
    return pipeline_run


@pytest.fixture(scope="session")
def student(report: RunArtifacts) -> dict[str, Any]:
    return report.get("quality.student")


@pytest.fixture(scope="session")
def student_items(report: RunArtifacts) -> list[dict[str, Any]]:
    """The student's per-item outcomes (``eval/item_scores.json``; f1_lax/f1_strict None: not eligible)."""
    return report.run.student_item_scores()


@pytest.fixture(scope="session")
def quality_interval(student_items: list[dict[str, Any]]) -> Callable[[str], Interval | None]:
    """``metric -> Interval``: n and 95% CI of a student quality figure from its per-item outcomes (rates: Wilson
    over their own denominators, items or calls; the macro F1: a t interval over the eligible items)."""
    eligible = [row for row in student_items if row["f1_lax"] is not None]

    def count(key: str) -> int:
        return sum(int(row[key]) for row in student_items)

    def interval(metric: str) -> Interval | None:
        if metric == "f1_lax_macro":
            return mean_interval([row["f1_lax"] for row in eligible])
        hits, total = {"tool_selection": ("selection_ok", None), "privacy_ok_rate": ("privacy_ok", None),
                       "json_validity": ("calls_valid", "calls_emitted"),
                       "fixture_hit_rate": ("fixture_hits", "fixture_calls")}[metric]
        return wilson_interval(count(hits), count(total) if total else len(student_items))

    return interval


@pytest.fixture(scope="session")
def teacher(report: RunArtifacts) -> dict[str, Any]:
    return report.get("quality.teacher")


# -- speed ---------------------------------------------------------------------------------

SpeedMeasure = Callable[[str], Callable[[int], list[float]]]  # metric -> (n -> n samples)


def _speed_probe(run: RunArtifacts, model_path: Path, coreml: bool = False) -> SpeedMeasure:
    """Live samples from the speed harness on ``model_path``: PyTorch engine, or the run's Core ML export."""
    import torch

    from distillgates.data.chat import render_prompt
    from distillgates.model import load_model
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.speed import measure_speed
    from distillgates.tokenizer import END, EOS

    torch.set_num_threads(1)  # shared CI cores: one thread gives the least noisy samples
    tokenizer = run.run.tokenizer()
    prompts = [render_prompt(item) for item in run.run.items("eval")[:8]]
    model = load_model(model_path)
    if coreml:  # macOS only: MLModel.predict cannot run elsewhere
        from distillgates.runtime.coreml_engine import CoreMLEngine

        engine: Any = CoreMLEngine.from_export_dir(run.run.require(run.run.export_dir))
    else:
        engine = TorchEngine(model)
    backend = "coreml" if coreml else "torch"
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in (END, EOS)]

    def for_metric(metric: str) -> Callable[[int], list[float]]:
        calls = [0]  # successive calls rotate through the prompts (paired mode asks for 1 sample at a time)

        def measure(n: int) -> list[float]:
            samples: list[float] = []
            while len(samples) < n:
                start = calls[0] % len(prompts)
                calls[0] += 1
                rotated = prompts[start:] + prompts[:start]
                count = min(n - len(samples), len(prompts))
                repeats = math.ceil((n - len(samples)) / count)
                cfg = SpeedConfig(n_prompts=count, warmup=1, repeats=repeats, max_new_tokens=32)
                result = measure_speed(engine, tokenizer, rotated[:count], cfg, model_config=model.config,
                                       stop_ids=stop_ids, backend=backend)
                if not result[metric]["samples"]:
                    raise RuntimeError(f"speed harness returned no {metric} samples for {model_path}")
                samples += result[metric]["samples"]
            return samples[:n]

        return measure

    return for_metric


@pytest.fixture(scope="session")
def speed_measure(report: RunArtifacts, gate_session: Any) -> SpeedMeasure:
    """Measure the run's student live: the Core ML export on macOS, else the PyTorch engine.

    Paired mode measures both arms with the PyTorch engine (the blessed reference is a
    checkpoint), so the two arms always run on the same engine.
    """
    coreml = sys.platform == "darwin" and report.run.contract.exists() and not gate_session.options.speed.paired
    return _speed_probe(report, report.run.require(report.run.model_path()), coreml=coreml)


@pytest.fixture(scope="session")
def speed_reference(report: RunArtifacts) -> Callable[[BaselineEntry], SpeedMeasure]:
    """Paired mode: measure the blessed reference model (path + sha256 recorded at bless time)."""

    def build(entry: BaselineEntry) -> SpeedMeasure:
        ref = entry.provenance.get("reference_model") or {}
        path = Path(ref.get("path", ""))
        if not path.is_file() or sha256_file(path) != ref.get("sha256"):
            raise AssertionError(f"paired mode: blessed reference model {ref or '<none>'} is missing or changed; "
                                 "re-bless, or run without --speed-paired")
        return _speed_probe(report, path)

    return build


@pytest.fixture(scope="session")
def reference_model_provenance(report: RunArtifacts) -> dict[str, Any]:
    """Recorded when blessing a speed gate so ``--speed-paired`` can re-measure the blessed model."""
    path = report.run.model_path().resolve()
    if not path.is_file():
        return {"reference_model": None}  # paired mode then refuses loudly (speed_reference)
    return {"reference_model": {"path": str(path), "sha256": sha256_file(path)}}


@pytest.fixture(scope="session")
def eval_set_header(report: RunArtifacts) -> dict[str, Any]:
    """The header line of the run's eval set (dataset version and fingerprints)."""
    with report.run.require(report.run.dataset("eval")).open() as f:
        return json.loads(f.readline())
