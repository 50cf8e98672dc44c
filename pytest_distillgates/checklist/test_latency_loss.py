"""Latency-loss gates: the student answers shorter than the teacher, adds no false tool calls, and emits
its first tool call early (TTFA, in tokens: read from the report, so it runs in every session)."""

from __future__ import annotations

import pytest


@pytest.mark.latency_loss
def test_median_tokens_out(gate, student, teacher, thresholds):
    measured = (student.get("median_tokens_out"), teacher.get("median_tokens_out"))
    # a missing or zero teacher median gives no ratio: None, which fails the gate with the numbers
    ratio = measured[0] / measured[1] if None not in measured and measured[1] else None
    gate.at_most("median_tokens_out_ratio", ratio, thresholds.median_tokens_ratio_max,
                 f"median tokens out, student / teacher ({student['median_tokens_out']} / "
                 f"{teacher['median_tokens_out']})", n=student["n"])


@pytest.mark.latency_loss
def test_no_new_false_tool_calls(gate, student, teacher):
    gate.over("false_tool_calls_tool_absent", student.get("tool_absent_items"), "without a tool to call")
    gate.at_most("false_tool_calls_tool_absent", student["false_tool_calls_tool_absent"],
                 teacher["false_tool_calls_tool_absent"],
                 "tool calls on the tool-absent slice: student must not exceed the teacher",
                 n=student["tool_absent_items"])


@pytest.mark.latency_loss
def test_ttfa_p95(gate, student, thresholds):
    gate.at_most("ttfa_tokens_p95", student["ttfa_tokens_p95"], thresholds.ttfa_p95_tokens_max,
                 "p95 tokens until the first complete valid tool JSON (items with a valid call; None: no such item)",
                 n=student.get("ttfa_items"))
