"""Shape-drift gates: per enumerated shape, F1 lax must not drop more than the threshold vs baseline."""

from __future__ import annotations

import pytest


@pytest.mark.shape_drift
def test_shape_drift(gate, student, thresholds, shape):
    # a shape the run enumerates but no eval item exercised has no slice: None, which fails (and is never blessed)
    value = student["slices"]["shape"].get(shape, {}).get("f1_lax_macro")
    gate.no_regression(f"f1_lax_macro[shape={shape}]", value, f"f1_lax_macro.shape.{shape}",
                       tolerance=thresholds.shape_drift_max, higher_is_better=True,
                       definition=f"integration F1 lax on the {shape}-token shape slice (None: no eval item has "
                                  "this shape); ΔF1 vs baseline")
