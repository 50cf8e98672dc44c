"""F1 drift gates: ΔF1 lax and strict of the student vs its blessed baseline (hardware-independent)."""

from __future__ import annotations

import pytest


@pytest.mark.f1_drift
@pytest.mark.parametrize("mode", ["lax", "strict"])
def test_f1_drift(gate, student, thresholds, mode):
    metric = f"f1_{mode}_macro"
    gate.no_regression(metric, student[metric], tolerance=-thresholds.f1_drift_min, higher_is_better=True,
                       definition=f"integration F1 {mode} (macro); ΔF1 vs baseline >= {thresholds.f1_drift_min}")
