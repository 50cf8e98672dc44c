"""Identity gates: the report, the checkpoint and the export all describe the same model.

With ``--run-dir`` the quality gates read ``reports/report.json`` while the speed and Core ML gates
load ``student/model.pt`` and ``export/``: a stale report (or a retrained student that was not
exported again) would let one model's quality vouch for another model's speed.
"""

from __future__ import annotations

import pytest

from distillgates.model import model_fingerprint


@pytest.fixture(scope="session")
def checkpoint_fingerprint(report):
    """``model_fingerprint`` (config + weights) of the run's ``student/model.pt``."""
    return model_fingerprint(report.run.load_model())


@pytest.mark.determinism
def test_report_describes_the_checkpoint(gate, report, checkpoint_fingerprint):
    gate.equals("identity.model_fingerprint.report", report.get("header.fingerprints.model_fingerprint"),
                checkpoint_fingerprint,
                f"header.fingerprints.model_fingerprint of {report.report_path} (measured) equals the "
                f"model_fingerprint of {report.run.model_path()} (threshold)")


@pytest.mark.determinism
def test_export_describes_the_checkpoint(gate, report, checkpoint_fingerprint):
    contract = report.run.read_json(report.run.contract)
    gate.equals("identity.model_fingerprint.export", contract.get("model_fingerprint"), checkpoint_fingerprint,
                f"model_fingerprint recorded by the export in {report.run.contract} (measured) equals the "
                f"model_fingerprint of {report.run.model_path()} (threshold)")


@pytest.mark.determinism
def test_packages_are_the_exported_ones(gate, report):
    """The packages in ``export/`` are the ones the export step wrote (and measured: parity, residency): no
    package missing, changed, or added since."""
    current, recorded = report.run.package_digests()
    gate.equals("identity.package_sha256", current or "no package", recorded,
                f"sha256 of every file of each package in {report.run.export_dir} (measured; None: missing) equals "
                f"package_sha256 recorded by the export in {report.run.contract} (threshold)")
