"""Shape-drift gates: per enumerated shape, the student's per-item F1 lax must not drop (paired by item id)
more than the threshold vs baseline, significantly."""

from __future__ import annotations

import pytest


@pytest.mark.shape_drift
def test_shape_drift(gate, student_items, thresholds, shape):
    # a shape the run enumerates but no eval item exercised has no items: the mean is None, which fails
    items = {row["id"]: row["f1_lax"] for row in student_items if row["shape"] == shape and row["f1_lax"] is not None}
    gate.paired_no_regression(f"f1_lax_macro[shape={shape}]", items, f"f1_lax_macro.shape.{shape}",
                              tolerance=thresholds.shape_drift_max, alpha=thresholds.significance_alpha,
                              definition=f"integration F1 lax on the {shape}-token shape slice (None: no eval item "
                                         "has this shape); paired per-item ΔF1 vs baseline")
