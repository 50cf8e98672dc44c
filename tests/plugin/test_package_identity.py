"""The exported packages are bound to what was gated (issue #31, item 2)."""

from __future__ import annotations

import json
import shutil

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
        arms.coreml = True  # as on macOS with an export
        with pytest.raises(RunArtifactError, match=r"not the packages the export wrote: model\.mlpackage"):
            arms.candidate()
        with pytest.raises(RunArtifactError, match="not the packages the export wrote"):
            arms.record()
        assert arms.workers == []  # no worker started
    finally:
        arms.close()
