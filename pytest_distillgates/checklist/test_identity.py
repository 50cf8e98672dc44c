"""Identity gates: the report, the checkpoint and the export all describe the same model.

With ``--run-dir`` the quality gates read ``reports/pipeline_run.json`` while the speed and Core ML gates
load ``student/model.pt`` and ``export/``: a stale report (or a retrained student that was not
exported again) would let one model's quality vouch for another model's speed.
"""

from __future__ import annotations

import pytest

from pytest_distillgates.fixtures import item_figures

# these read the run as it is (``pipeline_run``): the ``report`` fixture refuses a report of another model


@pytest.mark.determinism
def test_report_describes_the_checkpoint(gate, pipeline_run, checkpoint_fingerprint):
    gate.equals("identity.model_fingerprint.report", pipeline_run.get("header.fingerprints.model_fingerprint"),
                checkpoint_fingerprint,
                f"header.fingerprints.model_fingerprint of {pipeline_run.report_path} (measured) equals the "
                f"model_fingerprint of {pipeline_run.run.model_path()} (threshold)")


@pytest.mark.determinism
def test_export_describes_the_checkpoint(gate, pipeline_run, checkpoint_fingerprint):
    contract = pipeline_run.run.read_json(pipeline_run.run.contract)
    gate.equals("identity.model_fingerprint.export", contract.get("model_fingerprint"), checkpoint_fingerprint,
                f"model_fingerprint recorded by the export in {pipeline_run.run.contract} (measured) equals the "
                f"model_fingerprint of {pipeline_run.run.model_path()} (threshold)")


@pytest.mark.determinism
def test_packages_are_the_exported_ones(gate, pipeline_run):
    """The packages in ``export/`` are the ones the export step wrote (and measured: parity, residency): no
    package missing, changed, or added since."""
    current, recorded = pipeline_run.run.package_digests()
    gate.equals("identity.package_sha256", current or "no package", recorded,
                f"sha256 of every file of each package in {pipeline_run.run.export_dir} (measured; None: missing) "
                f"equals package_sha256 recorded by the export in {pipeline_run.run.contract} (threshold)")


@pytest.mark.determinism
def test_report_scores_are_the_item_scores(gate, report, student, drawn_student_items):
    """The quality gates read the report's figures, the drift gates the per-item scores: both must be one scoring
    of one eval (a report left from before ``distillgates eval`` re-scored the outputs would vouch for the old
    scoring)."""
    measured = {metric: round(value, 9) if value is not None else None
                for metric, value in item_figures(drawn_student_items).items()}
    reported = {metric: round(student[metric], 9) if student.get(metric) is not None else None for metric in measured}
    gate.equals("identity.quality.item_scores", measured, reported,
                f"the student's figures recomputed from {report.run.item_scores} (measured; the items as drawn) equal "
                f"quality.student of {report.report_path} (threshold); if not, run the report step again")
