"""The gates' fixtures: thresholds, enumerated shapes, the run report, speed samplers.

Registered by the plugin (``pytest_plugins`` in :mod:`pytest_distillgates.plugin`), so the shipped
checklist and a project's own gate tests use the same fixtures; a project's ``conftest.py`` may
override any of them. The plugin itself provides ``gate``, ``pipeline_run``, ``hardware_profile``
and ``baseline_store``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distillgates.config import GatesConfig, load_config
from distillgates.gates.references import ReferenceStore
from distillgates.gates.session import GateSession, RunArtifacts
from distillgates.gates.speed_ab import ArmFactory, ReferenceFactory, SpeedRounds, WorkerArms
from distillgates.gates.stats import Interval, corrected_ratio, mean_interval, wilson_interval
from distillgates.hardware import GatingPolicy, load_profiles
from distillgates.rundir import RunArtifactError
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
    if "export_function" in metafunc.fixturenames:  # the functions of the exported package: prefill per shape, decode
        from distillgates.export.functions import function_names

        metafunc.parametrize("export_function", function_names([int(s) for s in _shapes(metafunc.config)]))


@pytest.fixture(scope="session")
def thresholds(gate_session: GateSession) -> GatesConfig:
    """The gate thresholds: the embedded ones, each key the project's thresholds file sets replaced; which
    file each came from is recorded in the gate report, the summary and the terminal table."""
    return gate_session.thresholds()


@pytest.fixture(scope="session")
def speed_policy(hardware_profile: str, thresholds: GatesConfig, gate_session: GateSession) -> GatingPolicy:
    """The speed gating policy of the selected hardware profile (the project's hardware profiles, else the
    embedded ones): its ``max_regression`` is the gate threshold and every worker process is asked for at
    least its ``min_samples``. A machine without a profile (a generated key) uses ``gates.speed_regression_max``."""
    profiles = {p.key: p for p in load_profiles(gate_session.project.hardware_profiles_path)}
    if hardware_profile not in profiles:
        return GatingPolicy(max_regression=thresholds.speed_regression_max, min_samples=2)
    policy = profiles[hardware_profile].gating
    speed = gate_session.context.speed
    speed.samples = max(speed.samples, policy.min_samples)
    return policy


@pytest.fixture(scope="session")
def checkpoint_fingerprint(pipeline_run: RunArtifacts) -> str:
    """``model_fingerprint`` (config + weights) of the run's ``student/model.pt``."""
    from distillgates.model import model_fingerprint

    return model_fingerprint(pipeline_run.run.load_model())


@pytest.fixture(scope="session")
def report(pipeline_run: RunArtifacts, checkpoint_fingerprint: str) -> RunArtifacts:
    """The run's report, once it is known to describe ``student/model.pt``: in every session that reads it (``-m
    quality`` alone too), a report of another model is an error naming both fingerprints (the identity gates,
    ``test_identity.py``, record the comparison)."""
    described = pipeline_run.header.get("fingerprints", {}).get("model_fingerprint")
    if described != checkpoint_fingerprint:
        raise RunArtifactError(f"{pipeline_run.report_path}: header.fingerprints.model_fingerprint {described!r} is "
                               f"not the model_fingerprint {checkpoint_fingerprint!r} of "
                               f"{pipeline_run.run.model_path()}: the report describes another model (re-run the "
                               "eval and report steps)")
    return pipeline_run


@pytest.fixture(scope="session")
def student(report: RunArtifacts) -> dict[str, Any]:
    return report.get("quality.student")


@pytest.fixture(scope="session")
def student_items(report: RunArtifacts) -> list[dict[str, Any]]:
    """The student's per-item outcomes (``eval/item_scores.json``; f1_lax/f1_strict None: not eligible)."""
    return report.run.student_item_scores()


@pytest.fixture(scope="session")
def drawn_student_items(student_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-item outcomes behind the student's quality figures: the eval items as drawn, without the top-up
    that ``data.eval_min_per_shape`` adds for the drift gates (``top_up`` rows)."""
    return [row for row in student_items if not row.get("top_up")]


# the gated student figures as counts over per-item rows: (successes, denominator; None: the items)
_RATES = {"tool_selection": ("selection_ok", None), "privacy_ok_rate": ("privacy_ok", None),
          "json_validity": ("calls_valid", "calls_emitted"), "fixture_hit_rate": ("fixture_hits", "fixture_calls")}


def _counts(rows: list[dict[str, Any]], metric: str) -> tuple[int, int]:
    hits, total = _RATES[metric]
    return sum(int(row[hits]) for row in rows), sum(int(row[total]) for row in rows) if total else len(rows)


def item_figures(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The student's gated quality figures recomputed from its per-item rows (None: no item to measure)."""
    f1 = [row["f1_lax"] for row in rows if row["f1_lax"] is not None]
    rates = {metric: hits / total if total else None for metric in _RATES for hits, total in [_counts(rows, metric)]}
    return {"f1_lax_macro": sum(f1) / len(f1) if f1 else None, **rates}


def item_interval(rows: list[dict[str, Any]], metric: str) -> Interval | None:
    """n and 95% CI of a quality figure from the per-item outcomes ``rows`` it summarises (rates: Wilson over their own
    denominators, items or calls; the macro F1: a t interval over the eligible items)."""
    if metric == "f1_lax_macro":
        return mean_interval([row["f1_lax"] for row in rows if row["f1_lax"] is not None])
    return wilson_interval(*_counts(rows, metric))


def _ratio_terms(row: dict[str, Any], metric: str) -> tuple[float, float]:
    """One item's (numerator, denominator) of a quality figure: the macro F1 is a ratio over eligible items too."""
    if metric == "f1_lax_macro":
        return (0.0, 0.0) if row["f1_lax"] is None else (float(row["f1_lax"]), 1.0)
    hits, total = _RATES[metric]
    return float(row[hits]), float(row[total]) if total else 1.0


def corrected_figure(rows: list[dict[str, Any]], sampled: list[dict[str, Any]], metric: str) \
        -> tuple[float | None, Interval | None]:
    """A quality figure of what ships over every item of ``rows`` (the eval step's, from PyTorch): ``rows``' figure
    corrected by the differences of ``sampled`` (the same items' rows from the shipped asset, a random sample of
    ``rows``) from their ``rows`` (:func:`~distillgates.gates.stats.corrected_ratio`); ``rows``' own figure and interval
    where the asset scores every sampled item as PyTorch does. ``(None, None)`` when a sampled item is not in
    ``rows`` (the two come from different eval sets)."""
    by_id = {row["id"]: row for row in rows}
    if any(row["id"] not in by_id for row in sampled):
        return None, None
    y, x = zip(*(_ratio_terms(row, metric) for row in rows), strict=True) if rows else ((), ())
    paired = [(_ratio_terms(row, metric), _ratio_terms(by_id[row["id"]], metric)) for row in sampled]
    dy, dx = [a[0] - b[0] for a, b in paired], [a[1] - b[1] for a, b in paired]
    return corrected_ratio(y, x, dy, dx, item_interval(rows, metric))


@pytest.fixture(scope="session")
def quality_interval(drawn_student_items: list[dict[str, Any]]) -> Callable[[str], Interval | None]:
    """``metric -> Interval`` of a student quality figure (:func:`item_interval` of the drawn items)."""
    return lambda metric: item_interval(drawn_student_items, metric)


@pytest.fixture(scope="session")
def teacher(report: RunArtifacts) -> dict[str, Any]:
    return report.get("quality.teacher")


# -- speed ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def speed_arms(report: RunArtifacts, gate_session: GateSession) -> Iterator[WorkerArms]:
    """The session's speed workers (real path): the candidate on the run's artifacts, the reference on the
    blessed ones, fetched by digest from the reference store (:meth:`GateSession.reference_store`)."""
    arms = WorkerArms(report.run, ReferenceStore(gate_session.reference_store()))
    yield arms
    arms.close()


@pytest.fixture(scope="session")
def speed_candidate(speed_arms: WorkerArms) -> ArmFactory:
    """``speed_candidate()`` starts a fresh speed worker process of the run's student (``.measure(n)``,
    ``.close()``; closed at the end of the session at the latest)."""
    return speed_arms.candidate


@pytest.fixture(scope="session")
def speed_reference(speed_arms: WorkerArms) -> ReferenceFactory:
    return speed_arms.reference


@pytest.fixture(scope="session")
def speed_reference_record(speed_arms: WorkerArms) -> Callable[[], dict[str, Any]]:
    return speed_arms.record


@pytest.fixture(scope="session")
def speed_rounds(report: RunArtifacts, gate_session: Any, speed_policy: GatingPolicy, speed_candidate: ArmFactory,
                 speed_reference: ReferenceFactory,
                 speed_reference_record: Callable[[], dict[str, Any]]) -> SpeedRounds:
    """Every speed gate's samples (``--speed-mode``: ``ab`` interleaved with the blessed reference, or ``stored``);
    at bless, the candidate alone and the reference record stored with the baselines. Of the gated run
    (``report``): its fingerprints go with the blessed baselines."""
    settings = gate_session.context.speed
    ab = settings.mode == "ab" and not gate_session.options.bless
    return SpeedRounds(speed_candidate, samples=settings.samples, workers=settings.workers, looks=settings.looks,
                       reference=speed_reference if ab else None, record=speed_reference_record)


@pytest.fixture(scope="session")
def eval_set_header(report: RunArtifacts) -> dict[str, Any]:
    """The header line of the run's eval set (dataset version and fingerprints)."""
    with report.run.require(report.run.dataset("eval")).open() as f:
        return json.loads(f.readline())
