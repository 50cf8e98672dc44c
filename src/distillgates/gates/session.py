"""One gate session: options, hardware selection, run artifacts, baselines and reports.

The pytest plugin builds one :class:`GateSession` per pytest session (kept in
``config.stash``) and delegates everything but pytest glue to it.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from distillgates.config import GatesConfig
from distillgates.gates.baselines import BaselineStore
from distillgates.gates.core import Gate, GateContext, SpeedSettings
from distillgates.gates.outcomes import TestLog, TestOutcome, session_result, summarize_tests
from distillgates.gates.references import is_url
from distillgates.gates.report import write_json_report, write_markdown_summary
from distillgates.project import Project, Thresholds
from distillgates.rundir import RunArtifactError, RunDir


@dataclass
class GateOptions:
    """The plugin's command-line options (see ``pytest --help``, group distillgates)."""

    hw_profile: str | None = None
    bless: bool = False
    allow_cross_hw: bool = False
    allow_other_eval_set: bool = False
    baselines_dir: Path | None = None  # None: the project's (``baselines`` setting, default baselines/)
    run_dir: Path | None = None
    gate_report: Path | None = None
    gate_summary: Path | None = None
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    speed_inconclusive: str = "skip"  # "skip" or "fail"
    ci: str | None = None  # the CI variable set true (:func:`ci_variable`), None: not CI
    reference_store: str | None = None  # None: DISTILLGATES_REFERENCE_STORE, else the project's ``references``


REFERENCE_STORE_ENV = "DISTILLGATES_REFERENCE_STORE"


class RunArtifacts:
    """Read-only view of a pipeline run for the gates: its report, and its :class:`RunDir` (``.run``)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(run_dir)
        self.path = self.run.root
        self.report_path = self.run.report
        if not self.report_path.is_file():
            raise RunArtifactError(f"{self.report_path}: run report not found (is {self.path} a pipeline run dir?)")
        self.report: dict[str, Any] = self.run.read_json(self.report_path)

    def get(self, dotted: str) -> Any:
        """``report["a"]["b"]`` for ``"a.b"``; a missing key names the file and the key path."""
        node: Any = self.report
        for i, part in enumerate(dotted.split(".")):
            if not isinstance(node, dict) or part not in node:
                found = ".".join(dotted.split(".")[:i]) or "<root>"
                raise RunArtifactError(f"{self.report_path}: missing key {dotted!r} (no {part!r} under {found})")
            node = node[part]
        return node

    @property
    def header(self) -> dict[str, Any]:
        return self.report.get("header", {})

    def measured_on(self, figure: dict[str, Any] | None) -> str | None:
        """The hardware profile that measured a figure of the export (Core ML parity, ANE residency): the one
        recorded with it, else the report header's."""
        return (figure or {}).get("hardware_profile_key") or self.header.get("hardware", {}).get("hardware_profile_key")


def resolve_hardware(
    selected: str | None, profiles_path: Path | None = None
) -> tuple[str, str | None, dict[str, Any]]:
    """(profile key, mismatch message or None, hardware header) for this machine.

    ``profiles_path``: the project's hardware profiles (default: the embedded ones).

    ``--hw-profile`` selects a profile explicitly; when this machine is not that profile the
    mismatch message (from :func:`distillgates.hardware.select_profile`) makes every
    hardware-dependent gate refuse to compare unless cross-hardware comparison is allowed.
    """
    from distillgates import hardware  # lazy: only sessions that gate something need it

    detected = hardware.detect_hardware()
    profiles = hardware.load_profiles(profiles_path or hardware.DEFAULT_PROFILES_PATH)
    own = hardware.profile_key(detected, profiles)
    key = selected or own
    mismatch = None
    if key != own:
        try:
            hardware.select_profile(key, detected, allow_cross_hw=False, profiles=profiles)
        except hardware.HardwareMismatchError as err:
            mismatch = str(err)  # recorded, and every hardware-dependent gate fails with it
    return key, mismatch, hardware.hardware_header(profile_key=key)


# the CI systems' variables that say a job runs in CI; only a true value counts (CI=false is no CI)
CI_VARIABLES = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "CIRCLECI", "TF_BUILD")
TRUE_VALUES = ("1", "true", "yes", "on")


def ci_variable(environ: Mapping[str, str]) -> str | None:
    """``NAME=value`` of the first of :data:`CI_VARIABLES` set to a true value (1, true, yes, on; any case), else
    None: under CI an inconclusive speed gate, a gate that measured nothing and an underpowered drift gate fail."""
    return next((f"{name}={environ[name]}" for name in CI_VARIABLES
                 if environ.get(name, "").strip().lower() in TRUE_VALUES), None)


def git_sha(cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None  # not a git checkout / no git: provenance records null, nothing depends on it
    return out.stdout.strip() or None if out.returncode == 0 else None


class GateSession:
    """Everything a pytest session of gates shares; built lazily so plain unit-test runs pay nothing."""

    def __init__(self, options: GateOptions, project: Project) -> None:
        self.options = options
        self.project = project  # its config, thresholds, hardware profiles and baselines
        self.rootdir = project.root
        self.run: RunArtifacts | None = None
        self.messages: list[str] = []  # shown in the terminal summary
        # the gates' thresholds and the file each came from, shown in every report; None: no gate asked
        self.thresholds_used: Thresholds | None = None
        self.test_log = TestLog()  # every collected gate test's outcome (the plugin reports each phase)
        self.tests: list[TestOutcome] = []  # the log's tests with their final outcomes, set by finish()
        self.result: dict[str, Any] | None = None  # verdict, reason and counts of the session, set by finish()

    def thresholds(self) -> GatesConfig:
        """The gate thresholds (:meth:`Project.thresholds`), recorded for the reports."""
        if self.thresholds_used is None:
            self.thresholds_used = self.project.thresholds()
        return self.thresholds_used.values

    @property
    def thresholds_source(self) -> str | None:
        """Which file each threshold came from, in one line (None: no gate asked for thresholds)."""
        return self.thresholds_used.label() if self.thresholds_used else None

    @cached_property
    def hardware(self) -> tuple[str, str | None, dict[str, Any]]:
        return resolve_hardware(self.options.hw_profile, self.project.hardware_profiles_path)

    @property
    def profile(self) -> str:
        return self.hardware[0]

    def baselines_root(self) -> Path:
        root = self.options.baselines_dir
        if root is None:
            return self.project.baselines_dir
        return root if root.is_absolute() else self.rootdir / root

    def reference_store(self) -> str:
        """Where the speed references' artifacts live: ``--reference-store``, else ``$DISTILLGATES_REFERENCE_STORE``,
        else the project's ``references`` setting, else ``references/`` in the baselines folder. A folder (relative:
        to the project root) or an fsspec URL."""
        location = self.options.reference_store or os.environ.get(REFERENCE_STORE_ENV) or \
            self.project.settings.references
        if not location:
            return str(self.baselines_root() / "references")
        return location if is_url(location) else str(self.rootdir / location)

    def bless_command(self, nodeid: str) -> str:
        speed = "[speed" in nodeid or "test_speed" in nodeid
        # the speed gates share one reference (artifacts, code): they are blessed together, by file
        parts = ["pytest", nodeid.split("::")[0] if speed else nodeid, "--bless", f"--hw-profile={self.profile}"]
        if self.options.baselines_dir:
            parts.append(f"--baselines-dir={self.options.baselines_dir}")
        if self.options.run_dir:
            parts.append(f"--run-dir={self.options.run_dir}")
        if speed and self.options.reference_store:
            parts.append(f"--reference-store={self.options.reference_store}")
        if speed:
            parts += ["-m", "speed"]
        return shlex.join(parts)

    def _run_provenance(self) -> dict[str, Any]:
        run_header = self.run.header if self.run else {}
        config = run_header.get("config") or {}
        return {
            "git_sha": run_header.get("git_sha") or git_sha(self.rootdir),
            "config_sha256": run_header.get("config_sha256"),
            # which build of the config (``--seed``, ``--student-seed``): what tells another build from this one when
            # the config's fingerprint has since moved (a new field)
            "seeds": {"seed": config.get("seed"), "train.seed": (config.get("train") or {}).get("seed")},
            "run_dir": str(self.run.path) if self.run else None,
            "run_hardware": run_header.get("hardware"),
        }

    def attach_run(self, run: RunArtifacts) -> RunArtifacts:
        """Use ``run`` for every gate; its header becomes part of blessed baselines' provenance, and its
        fingerprints are what baselines are blessed with and checked against."""
        self.run = run
        if "context" in self.__dict__:
            self.context.provenance.update(self._run_provenance())
            self.context.run_fingerprints = run.header.get("fingerprints")
        return run

    @cached_property
    def context(self) -> GateContext:
        profile, mismatch, header = self.hardware
        provenance = {**self._run_provenance(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                      "hardware": header}
        return GateContext(
            store=BaselineStore(self.baselines_root(), profile), bless=self.options.bless,
            allow_cross_hw=self.options.allow_cross_hw, allow_other_eval_set=self.options.allow_other_eval_set,
            hardware_mismatch=mismatch, run_fingerprints=self.run.header.get("fingerprints") if self.run else None,
            provenance=provenance,
            speed=self.options.speed, bless_command=self.bless_command, ci=self.options.ci,
            waived=self._waived,
        )

    def _waived(self) -> dict[str, str]:
        """Check name -> the thresholds file whose ``waive`` names it."""
        waive = self.thresholds().waive
        assert self.thresholds_used is not None
        return {name: self.thresholds_used.sources.get("waive", "") for name in waive}

    def gate(self, nodeid: str, group: str, record: Any) -> Gate:
        return Gate(self.context, nodeid, group, record)

    def finish(self, interrupted: bool, exit_status: int = 0) -> None:
        """Commit blessed baselines (never after an interrupt) and write the reports."""
        if ("context" not in self.__dict__ and not self.test_log.tests
                and not (self.options.gate_report or self.options.gate_summary)):
            return  # no gate ran and no report asked for: plain unit-test sessions pay nothing
        context = self.context
        self.tests = self.test_log.finish({r.nodeid for r in context.records if r.verdict == "blessed"})
        verdict, why = session_result(self.tests, exit_status)
        self.result = {"verdict": verdict, "reason": why, "tests": summarize_tests(self.tests)}
        session: dict[str, Any] = {
            "result": self.result,
            "hardware_profile_key": self.profile, "bless": self.options.bless, "hardware": self.hardware[2],
            "hardware_mismatch": self.hardware[1], "run_dir": str(self.run.path) if self.run else None,
            "thresholds_source": self.thresholds_source,
            "threshold_sources": self.thresholds_used.sources if self.thresholds_used else None,
            "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        if self.options.bless and interrupted:
            self.messages.append("bless interrupted: no baseline was written, the old baselines are intact")
        elif self.options.bless:
            session["unused_baselines"] = context.store.unused()
            session["written_baselines"] = [str(p) for p in context.store.commit()]
            self.messages += [f"blessed baselines written: {p}" for p in session["written_baselines"]]
            self.messages += [f"baseline not used by any gate: {u}" for u in session["unused_baselines"]]
        if self.options.gate_report:
            write_json_report(self.options.gate_report, context.records, self.tests, session)
            self.messages.append(f"gate report written: {self.options.gate_report}")
        if self.options.gate_summary:
            write_markdown_summary(self.options.gate_summary, context.records, self.tests, session)
            self.messages.append(f"gate summary written: {self.options.gate_summary}")
