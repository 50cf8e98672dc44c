"""Speed gates on the real measurement path: speed harness + PyTorch engine on a tiny student.

Real timings are noisy, so the comparison run may pass or be inconclusive, never fail: the
student is compared with itself (an A/A check of the wiring; the statistics have their own
tests and the power benchmark). The comparison is paired (blessed reference and candidate
interleaved in one session): across sessions this shared box drifts by tens of percent, which
unpaired mode cannot tell from a regression (docs/gates.md, A/A figures)."""

from __future__ import annotations

import json

import pytest

from distillgates.config import load_config
from distillgates.data.build import build_data
from distillgates.model import Transformer, load_model, save_model
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir

from ..conftest import tiny_model_config
from .conftest import project_file


@pytest.fixture
def live_run(make_run):
    run = make_run("live")
    cfg = load_config(EMBEDDED_CONFIG)
    build_data(cfg, run / "data")
    tiny = tiny_model_config(vocab_size=cfg.tokenizer.vocab_size, max_seq_len=512)
    save_model(run / "student" / "model.pt", Transformer(tiny))
    RunDir(run).contract.unlink()  # not exported: the speed probe measures the PyTorch engine on every platform
    return run


def wiring_thresholds(pytester) -> None:
    """A wiring check, not a power test: on a ~1 ms TTFT two engine instances of the same weights
    differ by a few percent (allocation, cache placement), which a 5% gate may rightly call
    significant. The statistics' power is shown in benchmarks/bench_speed_gate_power.py."""
    project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  speed_regression_max: 0.25\n")


@pytest.mark.integration  # pytester runs measuring a live run (~5 s)
def test_bless_and_compare_live_samples(pytester, gates_project, live_run, own_profile):
    gates_project()
    wiring_thresholds(pytester)
    args = ["gates/test_speed.py", "-m", "speed", "-k", "ttft_ms-p50", f"--run-dir={live_run}",
            f"--hw-profile={own_profile}", "--speed-samples=10", "--speed-max-rounds=1", "--gate-report=r.json"]
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=1, deselected=3)
    entry = json.loads((pytester.path / "baselines" / own_profile / "speed.json").read_text())["entries"]["ttft_ms.p50"]
    assert len(entry["samples"]) == 10 and all(s > 0 for s in entry["samples"])
    assert entry["provenance"]["reference_model"]["path"].endswith("student/model.pt")
    result = pytester.runpytest(*args, "--speed-paired")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 1
    record = json.loads((pytester.path / "r.json").read_text())["gates"][0]
    assert record["verdict"] in ("pass", "inconclusive") and len(record["details"]["candidate_samples"]) >= 10


@pytest.mark.integration  # pytester runs measuring a live run (~4 s)
def test_paired_mode_measures_the_blessed_reference_and_refuses_a_changed_one(pytester, gates_project, live_run,
                                                                              own_profile):
    gates_project()
    wiring_thresholds(pytester)
    args = ["gates/test_speed.py", "-m", "speed", "-k", "tps-p50", f"--run-dir={live_run}",
            f"--hw-profile={own_profile}", "--speed-samples=10", "--speed-max-rounds=0"]
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=1, deselected=3)
    outcomes = pytester.runpytest(*args, "--speed-paired").parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 1
    retrained = load_model(live_run / "student" / "model.pt")
    retrained.embed.weight.data.mul_(1.01)  # a new student: the blessed reference file is overwritten
    save_model(live_run / "student" / "model.pt", retrained)
    result = pytester.runpytest(*args, "--speed-paired")
    result.assert_outcomes(failed=1, deselected=3)
    result.stdout.fnmatch_lines(["*paired mode: blessed reference model * is missing or changed*"])
