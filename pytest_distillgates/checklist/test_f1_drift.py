"""F1 drift gates: per-item integration F1 (lax and strict) of the student vs its blessed baseline, paired by
item id (hardware-independent): fail on a mean drop beyond the tolerance that is also significant."""

from __future__ import annotations

import pytest


@pytest.mark.f1_drift
@pytest.mark.parametrize("mode", ["lax", "strict"])
def test_f1_drift(gate, student_items, thresholds, mode):
    items = {row["id"]: row[f"f1_{mode}"] for row in student_items if row[f"f1_{mode}"] is not None}
    gate.paired_no_regression(f"f1_{mode}_macro", items, tolerance=-thresholds.f1_drift_min,
                              alpha=thresholds.significance_alpha,
                              definition=f"integration F1 {mode} (macro = mean over eligible items); paired per-item "
                                         f"ΔF1 vs baseline >= {thresholds.f1_drift_min} or not significant")
