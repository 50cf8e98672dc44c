"""distillgates pytest plugin: options, markers, fixtures, JUnit properties and the gate summary.

Thin by design (pytest-benchmark / syrupy style): every hook and fixture is a few lines that
delegate to :class:`distillgates.gates.session.GateSession` (kept in ``config.stash``) and the
library core in :mod:`distillgates.gates`. The gates' own fixtures (thresholds, the run's report,
speed samplers) are in :mod:`pytest_distillgates.fixtures`; the acceptance checklist ships in
:mod:`pytest_distillgates.checklist` and is collected in any distillgates project.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from distillgates.config import ConfigError
from distillgates.gates.core import Gate, GateInconclusive, GateNotMeasured, GateStopped, SpeedSettings
from distillgates.gates.report import counts_line
from distillgates.gates.session import CI_VARIABLES, GateOptions, GateSession, RunArtifacts, ci_variable
from distillgates.project import Project
from pytest_distillgates.checklist import CHECKLIST_DIR

pytest_plugins = ["pytest_distillgates.fixtures"]  # the gates' fixtures: the checklist's and a project's own gates

GATE_MARKERS = {
    "quality": "quality gate: F1 lax, tool selection, JSON validity, fixture hit-rate thresholds",
    "f1_drift": "F1 drift gate: ΔF1 lax/strict vs the blessed baseline",
    "privacy": "privacy gate: no PII echoed; controls never call tools or integrate results",
    "determinism": "determinism gate: sharded == unsharded eval; fingerprints present and equal; the report, "
                   "checkpoint and export describe one model",
    "latency_loss": "latency-loss gate: student output length vs teacher; no new false tool calls; TTFA p95",
    "shape_drift": "shape-drift gate: per enumerated shape, paired F1 lax drop vs the shape's blessed baseline",
    "qat_cosine": "QAT gate: probe cosine pre vs post QAT, no NaNs",
    "export": "export gate: exported program vs eager cosine, no int64 on attention, contract, ANE op-eligibility "
              "lint (static MIL)",
    "ane_residency": "ANE residency gate (macOS): MLComputePlan share on the ANE and drop vs the profile's baseline",
    "coreml_parity": "Core ML parity gate (macOS): Core ML vs PyTorch logits per shape and over decode steps",
    "coreai_parity": "Core AI parity gate: model.aimodel run by Core AI's runtime (Linux too) vs PyTorch logits, every "
                     "function: per enumerated length, over decode steps, top-1 agreement",
    "speed": "speed gate: TTFT p50/p95 and TPS p50/p5 vs the blessed reference of the profile, interleaved A/B "
             "(runs only with -m speed)",
    "speed_targets": "speed-target gate: the hardware profile's absolute TTFT/TPS bands (whole prompt, per shape) "
                     "and peak memory; no memory pressure (peak RSS share of RAM)",
    "prompt_cache": "prompt-cache gate: TTFT reduction with a cached prefix, hit rate",
    "speculative": "speculative-decoding gate: identical output, speedup, acceptance",
}
OTHER_MARKERS = {
    "requires_macos": "needs macOS (Core ML prediction, MLComputePlan, stateful models); skipped elsewhere",
    "integration": "slow: needs a pipeline run (every gate of the shipped checklist)",
}
SESSION_KEY = pytest.StashKey[GateSession]()
DESELECTED_KEY = pytest.StashKey[int]()
END_KEY = pytest.StashKey[str]()  # how a gate that decided nothing ended: inconclusive, stopped, not measured...
SPEED_DESELECTED = "speed gates measure live and run only when selected, e.g. pytest -m speed --hw-profile=<key>"
PROFILE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _profile_key(text: str) -> str:
    if not PROFILE_RE.match(text):
        raise argparse.ArgumentTypeError(f"invalid hardware profile key {text!r} (expected e.g. m1-max-64g)")
    return text


def _existing_dir(text: str) -> Path:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"run directory {text!r} does not exist")
    return Path(text)


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    return parse


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distillgates", "distillgates gates (quality and speed gates with blessed baselines)")
    group.addoption("--hw-profile", dest="dg_hw_profile", type=_profile_key, default=None, metavar="KEY",
                    help="hardware profile to gate against (e.g. m1-max-64g); default: detected")
    group.addoption("--bless", dest="dg_bless", action="store_true",
                    help="measure and write baselines instead of comparing with them")
    group.addoption("--allow-cross-hw", dest="dg_allow_cross_hw", action="store_true",
                    help="accept baselines or measurements from another hardware profile")
    group.addoption("--allow-other-eval-set", dest="dg_allow_other_eval_set", action="store_true",
                    help="accept baselines blessed on another eval set (dataset, tokenizer, tool registry or "
                         "prompt wrapper fingerprint differs from the run's)")
    group.addoption("--baselines-dir", dest="dg_baselines_dir", type=Path, default=None,
                    metavar="DIR", help="blessed baselines folder (default: the project's `baselines`, baselines/)")
    group.addoption("--run-dir", dest="dg_run_dir", type=_existing_dir, default=None, metavar="DIR",
                    help="pipeline run directory to gate; with no paths given, collects the shipped checklist "
                         "(default run: the project's config, else the embedded toy, built once and cached)")
    group.addoption("--gate-report", dest="dg_gate_report", type=Path, default=None, metavar="PATH",
                    help="write a JSON gate report here")
    group.addoption("--gate-summary", dest="dg_gate_summary", type=Path, default=None, metavar="PATH",
                    help="write a Markdown gate summary here (fits a CI job summary)")
    group.addoption("--reference-store", dest="dg_reference_store", default=None, metavar="PATH|URL",
                    help="where the speed references' artifacts live: a folder or an fsspec URL (s3://..., gs://...); "
                         "default: $DISTILLGATES_REFERENCE_STORE, else the project's `references` setting, else "
                         "<baselines dir>/references")
    group.addoption("--speed-mode", dest="dg_speed_mode", choices=("ab", "stored"), default="ab",
                    help="ab (default): measure the blessed reference (its commit's code on its stored artifacts) and "
                         "the candidate in alternating rounds in this session; stored: compare with the samples "
                         "stored at bless time (sensitive to the machine's speed drifting between sessions)")
    group.addoption("--speed-samples", dest="dg_speed_samples", type=_int_at_least(16), default=24, metavar="N",
                    help="speed samples per worker process and arm, measured in blocks of 8 (default: 24, at least 16)")
    group.addoption("--speed-workers", dest="dg_speed_workers", type=_int_at_least(2), default=6, metavar="N",
                    help="fresh speed worker processes per arm and measurement round (default: 6, at least 2): a "
                         "process keeps a speed offset for its life, so the statistics compare processes")
    group.addoption("--speed-max-rounds", dest="dg_speed_max_rounds", type=_int_at_least(0), default=3,
                    metavar="N", help="extra measurement rounds while a speed gate is inconclusive (default: 3); the "
                                      "false-alarm bound is split over all rounds")
    group.addoption("--speed-inconclusive", dest="dg_speed_inconclusive", choices=("skip", "fail"), default=None,
                    help="what an inconclusive speed gate does (default: fail under CI, i.e. when one of "
                         f"{', '.join(CI_VARIABLES)} is true, 1, yes or on, else skip; with the reason)")


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in {**GATE_MARKERS, **OTHER_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    opt = config.option
    ci = ci_variable(os.environ)
    options = GateOptions(
        hw_profile=opt.dg_hw_profile, bless=opt.dg_bless, allow_cross_hw=opt.dg_allow_cross_hw,
        allow_other_eval_set=opt.dg_allow_other_eval_set,
        baselines_dir=opt.dg_baselines_dir, run_dir=opt.dg_run_dir, gate_report=opt.dg_gate_report,
        gate_summary=opt.dg_gate_summary, reference_store=opt.dg_reference_store,
        speed_inconclusive=opt.dg_speed_inconclusive or ("fail" if ci else "skip"), ci=ci,
        speed=SpeedSettings(samples=opt.dg_speed_samples, workers=opt.dg_speed_workers,
                            max_extra_rounds=opt.dg_speed_max_rounds,
                            mode=opt.dg_speed_mode),
    )
    try:
        session = GateSession(options, Project.find(config.rootpath))
    except ConfigError as err:  # a bad distillgates.yaml / [tool.distillgates]: one line, not a traceback
        raise pytest.UsageError(str(err)) from err
    config.stash[SESSION_KEY] = session
    if _collects_checklist(config, session):
        config.args.append(str(CHECKLIST_DIR))


def _collects_checklist(config: pytest.Config, session: GateSession) -> bool:
    """The shipped checklist joins the collection when no paths were given (testpaths or the working
    directory) in a distillgates project (settings file) or with ``--run-dir``, unless a path already covers it."""
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        return False
    if session.project.source is None and session.options.run_dir is None:
        return False
    return not any(CHECKLIST_DIR.is_relative_to(Path(arg.split("::")[0]).resolve()) for arg in config.args)


def _is_gate_test(item: pytest.Item) -> bool:
    """A test the gate reports list: one of the checklist's, one with a gate marker, or one using ``gate``."""
    return (item.path.is_relative_to(CHECKLIST_DIR) or any(item.get_closest_marker(m) for m in GATE_MARKERS)
            or "gate" in getattr(item, "fixturenames", ()))


def _gate_group(item: pytest.Item) -> str:
    marker = next((m.name for m in item.iter_markers() if m.name in GATE_MARKERS), None)
    return marker or item.path.stem.removeprefix("test_")


def _gate_nodeid(item: pytest.Item) -> str:
    """The test's node id in the reports; the installed checklist's names its file, so that the bless
    command runs anywhere."""
    if not item.path.is_relative_to(item.config.rootpath):
        return f"{item.path}::{item.nodeid.split('::', 1)[1]}"
    return item.nodeid


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_gate_test(item):
            config = item.config
            speed = item.get_closest_marker("speed") and not re.search(r"\bspeed\b", config.option.markexpr or "")
            reason = SPEED_DESELECTED if speed else f"deselected (-m {config.option.markexpr!r}, " \
                                                    f"-k {config.option.keyword!r})"
            config.stash[SESSION_KEY].test_log.deselected(_gate_nodeid(item), _gate_group(item), reason)


def pytest_collection_finish(session: pytest.Session) -> None:
    log = session.config.stash[SESSION_KEY].test_log
    for item in session.items:
        if _is_gate_test(item):
            log.collected(_gate_nodeid(item), _gate_group(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                               ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if _is_gate_test(item):
        excinfo = call.excinfo
        if report.skipped and isinstance(report.longrepr, tuple):
            message = report.longrepr[2].removeprefix("Skipped: ")
        else:
            message = " ".join(excinfo.exconly().split()) if excinfo else ""
        item.config.stash[SESSION_KEY].test_log.phase(
            _gate_nodeid(item), call.when, report.outcome, message, special=item.stash.get(END_KEY, None),
            assertion=excinfo is not None and excinfo.errisinstance((AssertionError, pytest.fail.Exception)))
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if sys.platform != "darwin":
        skip = pytest.mark.skip(reason=f"requires macOS (running on {sys.platform}): Core ML prediction / "
                                       "MLComputePlan / stateful models are unavailable here")
        for item in items:
            if item.get_closest_marker("requires_macos"):
                item.add_marker(skip)
    # Speed gates measure live and need a quiet machine and a matching profile: opt-in only.
    if re.search(r"\bspeed\b", config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("speed")]
    if deselected:
        items[:] = [item for item in items if not item.get_closest_marker("speed")]
        config.hook.pytest_deselected(items=deselected)
        config.stash[DESELECTED_KEY] = len(deselected)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except GateInconclusive as err:
        item.stash[END_KEY] = "inconclusive"
        if item.config.stash[SESSION_KEY].options.speed_inconclusive == "fail":
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    except GateStopped as err:  # the session already failed on another speed gate
        item.stash[END_KEY] = "stopped"
        pytest.skip(str(err))
    except GateNotMeasured as err:  # nothing decided, outside CI or waived: "not measured" or "underpowered"
        item.stash[END_KEY] = err.verdict
        pytest.skip(str(err))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gate_session = session.config.stash.get(SESSION_KEY, None)
    if gate_session is not None:
        gate_session.finish(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED, exit_status=int(exitstatus))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    gate_session = config.stash.get(SESSION_KEY, None)
    deselected = config.stash.get(DESELECTED_KEY, 0)
    if deselected:
        terminalreporter.write_line(f"distillgates: {deselected} speed gate(s) deselected: {SPEED_DESELECTED}")
    if gate_session is None:
        return
    records = gate_session.context.records if "context" in gate_session.__dict__ else []
    if records or gate_session.tests:
        from rich.console import Console

        from distillgates.gates.report import rich_table

        buffer = io.StringIO()
        # at least 132 columns: CI logs report 80, and the check names are long
        Console(file=buffer, width=max(config.get_terminal_writer().fullwidth, 132), force_terminal=False).print(
            rich_table(records, gate_session.tests, gate_session.thresholds_source))
        terminalreporter.write(buffer.getvalue())
    if gate_session.result is not None and gate_session.tests:
        terminalreporter.write_line(f"distillgates gates: {counts_line(gate_session.result)}",
                                    red=gate_session.result["verdict"] == "fail", bold=True)
    for message in gate_session.messages:
        terminalreporter.write_line(f"distillgates: {message}")


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gate_session(request: pytest.FixtureRequest) -> GateSession:
    return request.config.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def hardware_profile(gate_session: GateSession) -> str:
    """The selected hardware profile key (``--hw-profile`` or detected)."""
    return gate_session.profile


@pytest.fixture(scope="session")
def baseline_store(gate_session: GateSession) -> Any:
    return gate_session.context.store


@pytest.fixture(scope="session")
def pipeline_run(gate_session: GateSession, tmp_path_factory: pytest.TempPathFactory) -> RunArtifacts:
    """The artifacts to gate: ``--run-dir``, else the project's config (default: the embedded toy) built
    once into runs/<name> (cached by fingerprint)."""
    if gate_session.run is None:
        run_dir = gate_session.options.run_dir
        if run_dir is None:
            from distillgates.config import load_config

            # exactly `distillgates run` (what `make run` does), in a fresh process: the build must not
            # inherit this session's torch state (tests change the thread count); the step cache
            # reuses every fresh step, so after `make run` nothing is rebuilt
            config_path = gate_session.project.config_path
            run_dir = gate_session.project.runs_dir / load_config(config_path).name
            cli = "import sys; from distillgates.cli import main; sys.exit(main(sys.argv[1:]))"
            subprocess.run([sys.executable, "-c", cli, "run", str(config_path), "--run-dir", str(run_dir)],
                           check=True, cwd=gate_session.rootdir)  # fmt: skip
        gate_session.attach_run(RunArtifacts(run_dir))
    assert gate_session.run is not None
    return gate_session.run


@pytest.fixture
def gate(request: pytest.FixtureRequest, gate_session: GateSession, record_property: Any) -> Gate:
    """Assertion helpers that record value, threshold, baseline, verdict and reason for this test."""
    return gate_session.gate(_gate_nodeid(request.node), _gate_group(request.node), record_property)
