"""Speculative-decoding gates: greedy output identical to the worker alone; speedup and acceptance gated."""

from __future__ import annotations

import pytest


@pytest.mark.speculative
def test_identical_output(gate, report):
    gate.equals("speculative.identical", report.get("gate_inputs.speculative.identical"), True,
                "greedy output with the drafter equals the worker's own greedy output")


@pytest.mark.speculative
@pytest.mark.parametrize(("key", "threshold_field"), [("speedup", "speculative_speedup_min"),
                                                      ("acceptance_rate", "speculative_acceptance_min")])
def test_speculative_figures(gate, report, thresholds, key, threshold_field):
    gate.at_least(f"speculative.{key}", report.get(f"gate_inputs.speculative.{key}"),
                  getattr(thresholds, threshold_field), f"speculative decoding {key} (worker steps vs plain decode)")
