"""The speed gates' measurements for one session: interleaved A/B against the blessed reference, or stored samples.

Two modes (``--speed-mode``):

- ``ab`` (default): the reference arm (the blessed commit's code on the blessed artifacts, see
  :mod:`distillgates.gates.references`) and the candidate arm (the current code on the current
  artifacts) run in speed worker processes (:mod:`distillgates.speed_worker`). A round starts
  ``workers`` fresh processes per arm and measures them as pairs, one reference and one candidate
  process at a time, asked for samples in alternating blocks, ABBA order, as ``asv continuous``
  does: slow drifts of the machine hit both processes of a pair alike and cancel in their ratio.
- ``stored``: only the candidate's processes are measured; their samples are compared with the
  samples stored at bless time. Sensitive to session drift: a shared machine that is a third
  slower today than at bless time reads as a regression.

Why fresh processes: a worker process keeps a speed offset for its whole life, so the statistics
take the process as the unit of replication (:mod:`distillgates.gates.stats`). The processes of a
round are started together (they load in parallel) and measured one pair after the other, each
pair alone on one CPU.

One :class:`SpeedRounds` serves every speed gate of the session: the samples of a round give
TTFT and TPS at once, and a gate that needs another look asks for one more round, which the
gates after it reuse (the statistics allow it: :func:`distillgates.gates.stats.sequential_speed_gate`).
Once a gate fails, the session has failed: no further round is measured, and a gate that would need
one ends undecided ("stopped", a skip naming the failed gate), so a regression fails in one round
instead of running every look for the other gates. Run such a gate alone to decide it.

The pipeline's speed step measures in speed workers too (the end of this module): the speed report's
``speed`` section in one fresh worker (:func:`report_speed`), and the speculative speedup in fresh workers
that each decode every prompt plainly and speculatively, back to back (:func:`speculative_speedup`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from distillgates.gates.references import PACKAGE_DIR, ReferenceStore, StaleReference, checkout_code, code_identity
from distillgates.gates.stats import MeasurementStopped
from distillgates.rundir import RunDir
from distillgates.speed_worker import METRICS, SpeedWorker, WorkerError

BLOCK = 8  # samples per request: one rotation of the worker's prompts; the arms of a pair alternate per block
MODES = ("ab", "stored")


class Arm(Protocol):
    """One worker process of an arm: ``measure(n)`` -> ``n`` samples per metric; ``close()`` ends it."""

    def measure(self, n: int) -> dict[str, list[float]]: ...

    def close(self) -> None: ...


ArmFactory = Callable[[], Arm]  # starts a fresh worker process of an arm
ReferenceFactory = Callable[[dict[str, Any], str], ArmFactory]  # (blessed reference record, re-bless command)


def measure_interleaved(arms: list[Arm], samples: int) -> list[dict[str, list[float]]]:
    """``samples`` samples per metric of each arm, after one unrecorded warm-up block each (the first decode of
    a process compiles), asked in alternating blocks of :data:`BLOCK` in ABBA BAAB order."""
    for arm in arms:
        arm.measure(BLOCK)
    got: list[dict[str, list[float]]] = [{m: [] for m in METRICS} for _ in arms]
    left, block = samples, 0
    while left > 0:
        n = min(BLOCK, left)
        order = range(len(arms)) if block % 4 in (0, 3) else reversed(range(len(arms)))  # ABBA BAAB ...
        for i in order:
            for metric, values in arms[i].measure(n).items():
                got[i][metric].extend(values)
        left -= n
        block += 1
    return got


class SpeedRounds:
    """Samples of the session per worker process, grown one round (``workers`` processes per arm) at a time,
    up to ``looks`` rounds.

    Args:
        candidate: starts a candidate worker process.
        samples: samples per process and arm (measured in blocks of :data:`BLOCK`, after one warm-up block).
        workers: fresh processes per arm and round.
        reference: builds the reference arm's factory from the blessed record (``ab`` mode; None: ``stored``).
        record: at bless, the reference record to store with the baselines (artifacts, code identity).
    """

    def __init__(self, candidate: ArmFactory, *, samples: int, workers: int, looks: int,
                 reference: ReferenceFactory | None = None, record: Callable[[], dict[str, Any]] | None = None) -> None:
        if samples < 1 or workers < 1 or looks < 1:
            raise ValueError(f"need samples, workers, looks >= 1; got {samples}, {workers}, {looks}")
        self.candidate_factory = candidate
        self.reference_factory = reference
        self.samples = samples
        self.workers = workers
        self.looks = looks
        self._record = record
        self._record_value: dict[str, Any] | None = None
        self.reference_arm: ArmFactory | None = None
        self.reference_record: dict[str, Any] | None = None
        self.rounds = 0
        self.stopped: str | None = None  # why no further round is measured (a gate of the session failed)
        # samples per process; process k of the two arms was measured as a pair
        self.candidate: dict[str, list[list[float]]] = {m: [] for m in METRICS}
        self.reference: dict[str, list[list[float]]] = {m: [] for m in METRICS}

    @property
    def mode(self) -> str:
        return "stored" if self.reference_factory is None else "ab"

    def bless_record(self) -> dict[str, Any]:
        """The reference to record with the blessed baselines (computed once per session)."""
        if self._record_value is None:
            self._record_value = {"speed_reference": self._record() if self._record else None}
        return self._record_value

    def use_reference(self, record: dict[str, Any] | None, rebless: str) -> None:
        """Prepare the reference arm of ``record`` (the same record for every gate of the session).

        Raises:
            StaleReference: no record, another record than the session's, or it cannot be re-run.
        """
        if not record:
            raise StaleReference("the speed baseline records no re-runnable reference (blessed before interleaved "
                                 f"A/B speed gates, or in --speed-mode=stored); re-bless: {rebless}")
        if self.reference_arm is not None:
            if record != self.reference_record:
                raise StaleReference(f"this speed baseline was blessed with another reference than the session's "
                                     f"other speed gates ({record} vs {self.reference_record}); re-bless: {rebless}")
            return
        assert self.reference_factory is not None
        self.reference_arm = self.reference_factory(record, rebless)
        self.reference_record = record

    def stop(self, why: str) -> None:
        """Measure no further round: the session has failed (``why``); gates that need more looks end undecided."""
        self.stopped = self.stopped or why

    def _measure_pair(self, arms: list[tuple[Arm, dict[str, list[list[float]]]]]) -> None:
        got = measure_interleaved([arm for arm, _ in arms], self.samples)
        for (_, into), samples in zip(arms, got, strict=True):
            for metric in METRICS:
                into[metric].append(samples[metric])

    def _round(self) -> None:
        # start every process of the round first: they load in parallel, then wait idle for their turn
        pairs: list[list[tuple[Arm, dict[str, list[list[float]]]]]] = []
        try:
            for _ in range(self.workers):
                pair: list[tuple[Arm, dict[str, list[list[float]]]]] = []
                pairs.append(pair)
                if self.reference_arm is not None:
                    pair.append((self.reference_arm(), self.reference))
                pair.append((self.candidate_factory(), self.candidate))
            for pair in pairs:
                self._measure_pair(pair)
                for arm, _ in pair:
                    arm.close()
        finally:
            for pair in pairs:
                for arm, _ in pair:
                    arm.close()
        self.rounds += 1

    def after(self, rounds: int, metric: str) -> tuple[list[list[float]], list[list[float]]]:
        """``(reference, candidate)`` samples per process of ``metric`` of exactly the first ``rounds`` rounds
        (measured when first needed; the gates share rounds, and each gate's looks see the same data whatever
        the order of the gates). The reference has no processes in ``stored`` mode."""
        if self.mode == "ab" and self.reference_arm is None:
            raise RuntimeError("ab mode: use_reference() must prepare the reference arm first")
        if not 1 <= rounds <= self.looks:
            raise ValueError(f"rounds must be in [1, {self.looks}], got {rounds}")
        while self.rounds < rounds:
            if self.stopped:
                raise MeasurementStopped(f"the session stopped measuring after round {self.rounds}: {self.stopped}")
            self._round()
        groups = rounds * self.workers
        return self.reference[metric][:groups], self.candidate[metric][:groups]


# -- workers on the real path --------------------------------------------------------------------


def _worker_args(run: RunDir, model: Path, export_dir: Path | None, backend: str = "coreml") -> list[str]:
    return ["--run-dir", str(run.root.absolute()), "--model", str(model.absolute()),
            *(["--export-dir", str(export_dir.absolute())] if export_dir else []),
            *(["--engine", "coreai"] if export_dir and backend == "coreai" else [])]  # older workers know no --engine


def measured_backend(run: RunDir) -> str:
    """What the speed gates measure: on macOS with an export its Core ML package (``coreml``), or where the export
    wrote the Core AI asset alone (``export.target: coreai``) that asset (``coreai``); elsewhere the PyTorch engine
    (``torch``)."""
    if sys.platform != "darwin" or not run.contract.exists():
        return "torch"
    contract = run.read_json(run.contract)
    return "coreml" if contract.get("packages") else "coreai" if "path" in contract.get("coreai", {}) else "torch"


class WorkerArms:
    """Owner of the session's speed workers and of the blessed code's checkout (removed by :meth:`close`).

    The candidate runs the code ``distillgates`` is imported from, on the run's artifacts; the reference runs
    the blessed commit (plus patch) on the blessed artifacts from ``store``. Both get this process's
    environment, except the engine slowdown test hook (``SLOWDOWN_ENV``), which stands for a change of the
    candidate's code and so never reaches the reference.
    """

    def __init__(self, run: RunDir, store: ReferenceStore) -> None:
        self.run = run
        self.store = store
        self.backend = measured_backend(run)
        self.workdir = Path(tempfile.mkdtemp(prefix="distillgates-speed-"))
        self.workers: list[SpeedWorker] = []
        # both processes of a pair on one CPU once loaded (they take turns): the same neighbours for both
        self.cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None

    def _start(self, worker: SpeedWorker) -> SpeedWorker:
        self.workers.append(worker)
        return worker

    def candidate(self) -> SpeedWorker:
        """A fresh candidate worker, started now (loading in the background); its first request waits for its
        handshake."""
        model = self.run.require(self.run.model_path())
        export = self.run.require(self.run.export_dir) if self.backend != "torch" else None
        if export is not None:  # an export measures only the packages it wrote (and the gates vouch for)
            self.run.verify_packages()
        args = _worker_args(self.run, model, export, self.backend)
        return self._start(_Lazy("candidate", PACKAGE_DIR.parent, args, cpu=self.cpu))

    def record(self) -> dict[str, Any]:
        """At bless: store the measured artifacts and the code identity; the record for the baselines."""
        artifacts = {"model": self.store.put(self.run.require(self.run.model_path()))}
        if self.backend != "torch":
            self.run.verify_packages()
            artifacts["export"] = self.store.put(self.run.require(self.run.export_dir))
        return {"code": code_identity(self.store).to_json(), "artifacts": artifacts, "backend": self.backend}

    def reference(self, record: dict[str, Any], rebless: str) -> Callable[[], SpeedWorker]:
        """Starts fresh workers of the blessed code on the blessed artifacts (checked out here, once).

        Raises:
            StaleReference: an artifact is missing or changed, or the code cannot be checked out.
        """
        from distillgates.runtime.torch_engine import SLOWDOWN_ENV

        artifacts = record.get("artifacts") or {}
        if "model" not in artifacts:
            raise StaleReference(f"the speed reference records no model artifact; re-bless: {rebless}")
        if self.backend != "torch" and ("export" not in artifacts or record.get("backend") != self.backend):
            raise StaleReference(f"the speed reference was blessed on backend {record.get('backend')!r}"
                                 f"{'' if 'export' in artifacts else ' without an export'}, this session measures "
                                 f"{self.backend}; re-bless: {rebless}")
        model = self.store.get(artifacts["model"], self.workdir / "artifacts", rebless)
        export = (self.store.get(artifacts["export"], self.workdir / "artifacts", rebless)
                  if self.backend != "torch" else None)  # fmt: skip
        source = checkout_code(record.get("code") or {}, self.store, self.workdir / "code", rebless)
        env = {k: v for k, v in os.environ.items() if k != SLOWDOWN_ENV}
        args = _worker_args(self.run, model, export, self.backend)
        return lambda: self._start(_Lazy("reference", source, args, env, rebless, self.cpu))

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class _Lazy(SpeedWorker):
    """A worker whose handshake happens at its first request, so that the processes of a round load in parallel.
    A reference worker that cannot speak the protocol (a commit from before it) names the re-bless command."""

    def __init__(self, name: str, source_dir: Path, args: list[str], env: dict[str, str] | None = None,
                 rebless: str | None = None, cpu: int | None = None) -> None:
        super().__init__(name, source_dir, args, env, cpu)
        self.rebless = rebless
        self.ready = False

    def measure(self, n: int, mode: str = "plain") -> dict[str, list[float]]:
        if not self.ready:
            try:
                self.handshake()
            except WorkerError as err:
                if self.rebless is None:
                    raise
                raise StaleReference(f"the blessed code cannot serve speed measurements: {err}; re-bless: "
                                     f"{self.rebless}") from err
            self.ready = True
        return super().measure(n, mode)


# -- the pipeline's speed step: measured in speed workers, as the gates measure -----------------------


def report_speed(run: RunDir, speed_config: dict[str, Any], export_dir: Path | None = None,
                 shapes: Sequence[int] = (), backend: str = "coreml") -> dict[str, Any]:  # fmt: skip
    """The speed report's ``speed`` section (``SpeedConfig`` fields ``speed_config``; ``per_shape`` for the
    enumerated prefill lengths ``shapes``), measured in one fresh speed worker process: one torch thread, the first
    decode's compilation in the untimed warm-up, and ``peak_memory_bytes`` of a process that holds only the model,
    the tokenizer and the engine. With ``export_dir``, ``backend`` says which of the export is timed (``coreml``,
    ``coreai``)."""
    args = _worker_args(run, run.require(run.model_path()), export_dir, backend)
    worker = SpeedWorker("speed report", PACKAGE_DIR.parent, args)
    try:
        worker.handshake()
        return worker.report(speed_config, shapes)
    finally:
        worker.close()


def speculative_speedup(run: RunDir, *, workers: int, samples: int) -> dict[str, list[list[float]]]:
    """TPS and TTFT samples of plain and of speculative decoding of the run's student (with the run's drafter), and
    of the drafter alone, per fresh speed worker process. Each process decodes every prompt plainly and
    speculatively back to back, each mode first on every other prompt (``measure-paired``: a slow stretch of the
    machine, and the caches the previous generation left, fall on both modes alike, so they cancel in the process's
    ratios; the processes are the replicates of :func:`distillgates.gates.stats.compare_speedup`), then the
    drafter alone. One process at a time, started when its turn comes: nothing loads while one measures, and the
    memory is one process's, whatever the model's size and ``workers``."""
    model, drafter = run.require(run.model_path()), run.require(run.model_path("drafter"))
    args = [*_worker_args(run, model, None), "--drafter", str(drafter.absolute())]
    cpu = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    out: dict[str, list[list[float]]] = {f"{metric}_{mode}": [] for metric in ("tps", "ttft")
                                         for mode in ("plain", "speculative", "drafter")}
    for _ in range(workers):
        worker = SpeedWorker("speculative", PACKAGE_DIR.parent, args, cpu=cpu)
        try:
            worker.handshake()
            got = {**worker.measure_paired(samples), "drafter": worker.measure(samples, "drafter")}
        finally:
            worker.close()
        for mode, samples_of in got.items():
            out[f"tps_{mode}"].append(samples_of["tps"])
            out[f"ttft_{mode}"].append(samples_of["ttft_ms"])
    return out
