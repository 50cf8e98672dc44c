"""Speed gates on the real path: speed workers (the current code, and the blessed commit's code from the
reference store) measuring a tiny student with the PyTorch engine, interleaved.

Real timings on a shared machine are noisy, so what these tests assert does not depend on the machine being
quiet: an A/A session never fails (it passes, or is inconclusive: skipped locally) with a wide wiring
threshold, and the slower engine is 4x slower (``DISTILLGATES_TEST_ENGINE_SLOWDOWN=3``, the candidate only).
The gates' false alarms and power at +10% / +20% are measured by benchmarks/bench_speed_gate_power.py."""

from __future__ import annotations

import json
import shutil

import pytest

from distillgates.config import load_config
from distillgates.model import Transformer, model_fingerprint, save_model
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from distillgates.runtime.torch_engine import SLOWDOWN_ENV

from ..conftest import tiny_model_config
from .conftest import project_file

pytestmark = pytest.mark.integration  # pytester sessions starting speed workers (a few seconds each)


@pytest.fixture
def live_run(make_run, toy_data):
    cfg = load_config(EMBEDDED_CONFIG)
    student = Transformer(tiny_model_config(vocab_size=cfg.tokenizer.vocab_size, max_seq_len=512))
    run = make_run("live", **{"header.fingerprints.model_fingerprint": model_fingerprint(student)})  # its report
    shutil.copytree(toy_data, run / "data", dirs_exist_ok=True)
    save_model(run / "student" / "model.pt", student)
    RunDir(run).contract.unlink()  # not exported: the workers measure the PyTorch engine on every platform
    return run


@pytest.fixture
def blessed(pytester, gates_project, live_run, own_profile, monkeypatch):
    """Bless the speed gates on the live run (wide wiring threshold: two processes of one model may differ by
    a few percent on a ~1 ms TTFT); returns the gate arguments."""
    monkeypatch.delenv(SLOWDOWN_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)
    gates_project()
    project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  speed_regression_max: 0.5\n")
    args = ["gates/test_speed.py", "-m", "speed", f"--run-dir={live_run}", f"--hw-profile={own_profile}",
            "--speed-samples=16", "--speed-workers=3", "--speed-max-rounds=1", "--gate-report=r.json"]
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=4)
    return args


def reference_record(pytester, profile):
    entries = json.loads((pytester.path / "baselines" / profile / "speed.json").read_text())["entries"]
    records = [entry["provenance"]["speed_reference"] for entry in entries.values()]
    assert all(r == records[0] for r in records)
    return records[0]


def test_a_a_never_fails_and_a_slower_engine_fails(pytester, blessed, own_profile, monkeypatch):
    record = reference_record(pytester, own_profile)
    store = pytester.path / "baselines" / "references" / "objects"
    assert (store / record["artifacts"]["model"]["sha256"]).is_file()
    assert len(record["code"]["commit"]) == 40 and record["backend"] == "torch"
    outcomes = pytester.runpytest(*blessed).parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4
    gates = json.loads((pytester.path / "r.json").read_text())["gates"]
    assert all(g["details"]["mode"] == "ab" and len(g["details"]["candidate_samples"]) >= 16 for g in gates)
    monkeypatch.setenv(SLOWDOWN_ENV, "3")  # the candidate's engine calls take 4x as long
    result = pytester.runpytest(*blessed)
    outcomes = result.parseoutcomes()
    # a gate that needs another round after the first failure is skipped undecided (no round is measured)
    assert outcomes.get("failed", 0) >= 1 and outcomes.get("failed", 0) + outcomes.get("skipped", 0) == 4
    result.stdout.fnmatch_lines(["*gate speed/* FAILED*ab mode: significant regression beyond threshold*"])


def test_a_reference_that_cannot_be_rerun_fails_with_the_rebless_command(pytester, blessed, own_profile):
    record = reference_record(pytester, own_profile)
    model = pytester.path / "baselines" / "references" / "objects" / record["artifacts"]["model"]["sha256"]
    baseline = pytester.path / "baselines" / own_profile / "speed.json"
    good_model, good_baseline = model.read_bytes(), baseline.read_text()
    rebless = f"re-bless: pytest gates/test_speed.py --bless --hw-profile={own_profile}*"
    for change, expected in [("missing", "*artifact 'model.pt' is missing*"),
                             ("changed", "*artifact * has changed: sha256*"),
                             ("unknown commit", "*blessed commit 0000000000000000000000000000000000000000 is not in*")]:
        if change == "missing":
            model.unlink()
        elif change == "changed":
            model.write_bytes(good_model + b"retrained")
        else:
            baseline.write_text(good_baseline.replace(record["code"]["commit"], "0" * 40))
        result = pytester.runpytest(*blessed)
        result.assert_outcomes(failed=4)
        result.stdout.fnmatch_lines([expected + rebless])
        model.write_bytes(good_model)
        baseline.write_text(good_baseline)


@pytest.mark.parametrize("where", ["folder", "url"])
def test_references_live_outside_the_repository_fetched_and_verified_by_digest(
        pytester, gates_project, live_run, own_profile, monkeypatch, tmp_path_factory, where):
    """The reference store outside git (a folder named in distillgates.yaml, or an fsspec URL given with
    --reference-store): the baselines keep only the digests; the gate fetches the model by digest and refuses one
    whose content is not its digest."""
    import fsspec

    monkeypatch.delenv(SLOWDOWN_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)
    gates_project()
    project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  speed_regression_max: 0.5\n")
    args = ["gates/test_speed.py", "-m", "speed", f"--run-dir={live_run}", f"--hw-profile={own_profile}",
            "--speed-samples=16", "--speed-workers=3", "--speed-max-rounds=0"]
    if where == "folder":
        folder = tmp_path_factory.mktemp("reference-store")
        with (pytester.path / "distillgates.yaml").open("a") as settings:
            settings.write(f"references: {folder}\n")
    else:
        url = f"memory://distillgates-test-{own_profile}"
        args.append(f"--reference-store={url}")
    pytester.runpytest(*args, "--bless").assert_outcomes(passed=4)
    assert not (pytester.path / "baselines" / "references").exists()  # only the digests are in baselines/
    sha = reference_record(pytester, own_profile)["artifacts"]["model"]["sha256"]
    if where == "folder":
        stored, write = folder / "objects" / sha, (folder / "objects" / sha).write_bytes
        good = stored.read_bytes()
    else:
        fs, stored = fsspec.filesystem("memory"), f"/distillgates-test-{own_profile}/objects/{sha}"
        good = fs.cat_file(stored)

        def write(data: bytes) -> None:
            fs.pipe_file(stored, data)
    outcomes = pytester.runpytest(*args).parseoutcomes()  # read back: an A/A session
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 4
    write(good + b"retrained")
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines([f"*artifact *{sha} has changed: sha256*blessed {sha}*re-bless*"])
