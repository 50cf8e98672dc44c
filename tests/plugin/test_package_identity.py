"""The exported packages are bound to what was gated (issue #31, item 2)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from distillgates.io import tree_sha256
from distillgates.rundir import RunArtifactError, RunDir


def test_tree_sha256_covers_every_file_and_its_path(tmp_path):
    pkg = tmp_path / "a.mlpackage"
    (pkg / "Data").mkdir(parents=True)
    (pkg / "Data" / "weight.bin").write_bytes(b"w")
    (pkg / "Manifest.json").write_text("{}")
    digest = tree_sha256(pkg)
    assert tree_sha256(pkg) == digest  # deterministic
    (pkg / "Data" / "weight.bin").write_bytes(b"x")
    assert tree_sha256(pkg) != digest
    (pkg / "Data" / "weight.bin").write_bytes(b"w")
    (pkg / "Data" / "weight.bin").rename(pkg / "Data" / "other.bin")
    assert tree_sha256(pkg) != digest


@pytest.mark.parametrize("damage", ["missing", "junk", "unrecorded", "no digests"])
def test_identity_gate_fails_on_a_missing_or_changed_package(pytester, gates_project, make_run, own_profile, damage):
    gates_project()
    run = make_run()
    export = run / "export"
    if damage == "missing":
        shutil.rmtree(export / "model.mlpackage")
    elif damage == "junk":
        (export / "model.mlpackage" / "Data" / "weight.bin").write_bytes(b"junk")
    elif damage == "unrecorded":
        (export / "other.mlpackage").mkdir()
        (export / "other.mlpackage" / "x").write_text("x")
    else:
        (export / "contract.json").write_text(json.dumps({"model_fingerprint": "m"}))
    result = pytester.runpytest("gates/test_identity.py::test_packages_are_the_exported_ones", f"--run-dir={run}",
                                f"--hw-profile={own_profile}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*identity.package_sha256 FAILED*"])


def test_identity_gate_passes_on_the_exported_packages(pytester, gates_project, make_run, own_profile):
    gates_project()
    pytester.runpytest("gates/test_identity.py::test_packages_are_the_exported_ones", f"--run-dir={make_run()}",
                       f"--hw-profile={own_profile}").assert_outcomes(passed=1)


def test_core_ml_figures_of_a_changed_package_are_an_error(pytester, gates_project, make_run, own_profile):
    """Parity and residency figures describe the packages the export measured: a changed package is an error."""
    gates_project()
    run = make_run()
    (run / "export" / "model.mlpackage" / "Data" / "weight.bin").write_bytes(b"junk")
    result = pytester.runpytest("gates/test_coreml_parity.py", "gates/test_ane_residency.py", f"--run-dir={run}",
                                f"--hw-profile={own_profile}")
    result.assert_outcomes(errors=12)  # 3 shapes + decode parity, 4 functions x 2 residency
    result.stdout.fnmatch_lines(["*not the packages the export wrote: model.mlpackage: sha256*"])


def test_verify_packages_names_each_package(tmp_path):
    run = RunDir(tmp_path)
    (run.export_dir / "model.mlpackage").mkdir(parents=True)
    (run.export_dir / "model.mlpackage" / "w").write_text("w")
    run.contract.write_text(json.dumps({"package_sha256": {"model.mlpackage": "0" * 64}}))
    with pytest.raises(RunArtifactError, match=r"model.mlpackage: sha256 [0-9a-f]{12} .* recorded 000000000000"):
        run.verify_packages()
    run.contract.write_text(json.dumps({"package_sha256": {"model.mlpackage": tree_sha256(run.export_dir /
                                                                                          "model.mlpackage")}}))
    assert run.verify_packages() == {"model.mlpackage": tree_sha256(run.export_dir / "model.mlpackage")}


def test_core_ml_speed_worker_refuses_a_changed_package(make_run, tmp_path):
    """On macOS the speed workers measure the export: only packages whose digest the export recorded."""
    from distillgates.gates.references import ReferenceStore
    from distillgates.gates.speed_ab import WorkerArms

    run = RunDir(make_run())
    (run.export_dir / "model.mlpackage" / "Data" / "weight.bin").write_bytes(b"junk")
    arms = WorkerArms(run, ReferenceStore(tmp_path / "store"))
    try:
        arms.backend = "coreml"  # as on macOS with an export
        with pytest.raises(RunArtifactError, match=r"not the packages the export wrote: model\.mlpackage"):
            arms.candidate()
        with pytest.raises(RunArtifactError, match="not the packages the export wrote"):
            arms.record()
        assert arms.workers == []  # no worker started
    finally:
        arms.close()


@pytest.mark.parametrize(("platform", "contract", "backend"), [
    ("linux", {"packages": {"model": {}}, "coreai": {"path": "model.aimodel"}}, "torch"),
    ("darwin", {"packages": {"model": {"path": "model.mlpackage"}}, "coreai": {"path": "model.aimodel"}}, "coreml"),
    ("darwin", {"packages": {}, "coreai": {"path": "model.aimodel"}}, "coreai"),  # export.target coreai
    ("darwin", {"packages": {}, "coreai": {"skipped": "no extra"}}, "torch"),
], ids=["linux", "mac-both", "mac-coreai-alone", "mac-nothing"])
def test_the_speed_gates_measure_what_the_export_wrote(tmp_path, monkeypatch, platform, contract, backend):
    """On macOS the export is timed: its Core ML package, or the Core AI asset where it wrote that alone (the worker
    is told so); elsewhere the PyTorch engine."""
    from distillgates.gates.speed_ab import _worker_args, measured_backend

    run = RunDir(tmp_path)
    run.export_dir.mkdir(parents=True)
    run.contract.write_text(json.dumps(contract))
    monkeypatch.setattr(sys, "platform", platform)
    assert measured_backend(run) == backend
    args = _worker_args(run, tmp_path / "model.pt", run.export_dir if backend != "torch" else None, backend)
    assert ("--engine" in args) == (backend == "coreai") and ("--export-dir" in args) == (backend != "torch")


@pytest.mark.parametrize("blessed", ["coreml", "torch"])
def test_a_reference_blessed_on_another_backend_is_stale(make_run, tmp_path, blessed):
    """A session timing the Core AI asset is never compared with a reference that timed the Core ML package or
    PyTorch: the re-bless command is named."""
    from distillgates.gates.references import ReferenceStore, StaleReference
    from distillgates.gates.speed_ab import WorkerArms

    arms = WorkerArms(RunDir(make_run()), ReferenceStore(tmp_path / "store"))
    try:
        arms.backend = "coreai"  # as on macOS 27 with export.target coreai
        record = {"artifacts": {"model": "m", **({"export": "e"} if blessed == "coreml" else {})}, "backend": blessed}
        with pytest.raises(StaleReference, match=rf"blessed on backend '{blessed}'.*this session measures coreai; "
                                                 r"re-bless: make bless"):
            arms.reference(record, "make bless")
    finally:
        arms.close()


def test_the_speed_worker_refuses_to_time_core_ai_off_macos(tmp_path, monkeypatch):
    from distillgates.speed_worker import COREAI_NOT_TIMED, speed_sampler

    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(ValueError, match=r"Linux runtime is a single-threaded reference implementation"):
        speed_sampler(tmp_path, tmp_path / "model.pt", tmp_path / "export", engine_name="coreai")
    assert "macOS 27" in COREAI_NOT_TIMED
