"""Quality gates: the student's absolute quality on the eval set (DESIGN.md gate table, `quality`)."""

from __future__ import annotations

import pytest

CHECKS = [  # (METRICS key, GatesConfig threshold field, definition)
    ("f1_lax_macro", "f1_lax_min", "integration F1 lax (macro over items): answer spans grounded in tool results"),
    ("tool_selection", "tool_selection_min", "predicted tool name (or no tool) equals expected"),
    ("json_validity", "json_validity_min", "every emitted call parses and validates against its tool schema"),
    ("fixture_hit_rate", "fixture_hit_rate_min", "share of calls the broker answered from fixtures"),
]


@pytest.mark.quality
@pytest.mark.parametrize(("metric", "threshold_field", "definition"), CHECKS, ids=[c[0] for c in CHECKS])
def test_quality(gate, student, quality_interval, thresholds, metric, threshold_field, definition):
    gate.at_least(metric, student[metric], getattr(thresholds, threshold_field), definition, quality_interval(metric))
