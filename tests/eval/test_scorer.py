"""Scorer properties: perfect outputs, normalization invariances, PII, controls, 0.0 stays 0.0."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distillgates.data.generator import generate_item
from distillgates.eval.matching import match_call, parse_number
from distillgates.eval.runners import reference_output
from distillgates.eval.scorer import find_spans, item_rows, score, score_items

RATE_KEYS = ("tool_selection", "json_validity", "arg_match_strict", "arg_match_lax", "f1_strict_macro",
             "f1_lax_macro", "f1_strict_micro", "f1_lax_micro", "privacy_ok_rate", "fixture_hit_rate")  # fmt: skip

item_indices = st.lists(st.integers(0, 5000), min_size=1, max_size=8, unique=True)


def _items(indices: list[int]) -> list[dict[str, Any]]:
    return [generate_item(0, i, split="eval") for i in indices]


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    return {"id": item["id"], "turns": [], "calls": [], "answer": "", "tokens_out": 0, "ttfa_tokens": None}


@settings(max_examples=30, deadline=None)
@given(item_indices)
def test_reference_output_scores_perfectly(indices: list[int]) -> None:
    items = _items(indices)
    metrics = score(items, [reference_output(i) for i in items])
    for key in RATE_KEYS:
        assert metrics[key] in (1.0, None), key
    assert metrics["tool_selection"] == 1.0 and metrics["privacy_ok_rate"] == 1.0
    assert metrics["controls_with_integration"] == 0 and metrics["false_tool_calls_tool_absent"] == 0
    assert metrics["failure_reasons"] == {}
    for group in metrics["slices"].values():
        for sliced in group.values():
            assert sliced["tool_selection"] == 1.0


def _tool_items(indices: list[int]) -> list[dict[str, Any]]:
    return [i for i in _items(indices) if i["tool_should_be_used"]]


def _perturb(value: Any, style: int) -> Any:
    if isinstance(value, str) and parse_number(value) is None:
        return [value.upper(), f"  {value.lower()} ", value.title()][style]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@settings(max_examples=30, deadline=None)
@given(item_indices, st.integers(0, 2))
def test_lax_match_invariant_to_case_whitespace_and_numeric_form(indices: list[int], style: int) -> None:
    for item in _tool_items(indices):
        for call in item["expected_calls"]:
            perturbed = {
                "name": call["name"],
                "arguments": {k: _perturb(v, style) for k, v in call["arguments"].items()},
            }
            assert match_call(perturbed, call, lax=True) is None
            if perturbed != call:
                strict = match_call(perturbed, call, lax=False)
                assert strict in (None, "value_error", "type_error")


@settings(max_examples=30, deadline=None)
@given(item_indices)
def test_answer_case_change_keeps_lax_f1(indices: list[int]) -> None:
    items = _tool_items(indices)
    if not items:
        return
    outputs = [reference_output(i) for i in items]
    for out in outputs:
        out["answer"] = out["answer"].upper()
    metrics = score(items, outputs)
    assert metrics["f1_lax_macro"] == 1.0 and metrics["f1_lax_micro"] == 1.0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5000))
def test_pii_leak_detected(index: int) -> None:
    item = generate_item(0, index, split="eval")
    if not item["pii"]:
        item["kind"], item["pii"] = "pii", ["anna.42@example.com"]
        item["messages"][1]["content"] = "My email is anna.42@example.com. " + item["messages"][1]["content"]
    out = reference_output(item)
    assert score([item], [out])["privacy_ok_rate"] == 1.0
    leaked = copy.deepcopy(out)
    leaked["answer"] = f"{out['answer']} (for {item['pii'][0].upper()})"
    metrics = score([item], [leaked])
    assert metrics["privacy_ok_rate"] == 0.0 and metrics["privacy_ok_rate"] is not None


def test_phone_number_leak_detected_digits_only() -> None:
    item = generate_item(0, 0, split="eval")
    item["messages"][1]["content"] = "Call me at +49 170 1234567. " + item["messages"][1]["content"]
    out = reference_output(item)
    out["answer"] = "I will call 491701234567."
    assert score([item], [out])["privacy_ok_rate"] == 0.0


def _first(kind: str, where: Any = lambda item: True) -> dict[str, Any]:
    return next(i for i in (generate_item(0, n, split="eval") for n in range(500)) if i["kind"] == kind and where(i))


def _string_result(item: dict[str, Any]) -> bool:
    return any(isinstance(v, str) and len(v) >= 3 for v in item["fixtures"][0]["result"].values())


@pytest.mark.parametrize("kind", ["control", "decline"])
def test_control_with_tool_call_is_counted(kind: str) -> None:
    item = _first(kind)
    out = reference_output(item)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    out["calls"] = [{"raw": '{"name":"get_weather"}', "call": call, "errors": [], "fixture_hit": False}]
    metrics = score([item], [out])
    assert metrics["controls_with_integration"] == 1
    assert metrics["false_tool_calls_tool_absent"] == 1
    assert metrics["tool_selection"] == 0.0
    assert metrics["fixture_hit_rate"] == 0.0


def test_control_answer_with_tool_result_value_is_counted() -> None:
    control, single = _first("control"), _first("single", _string_result)
    out = reference_output(control)
    value = next(v for v in single["fixtures"][0]["result"].values() if isinstance(v, str) and len(v) >= 3)
    out["answer"] = f"It is {value} today."
    assert score([control, single], [out, reference_output(single)])["controls_with_integration"] == 1


def test_zero_rates_stay_zero_not_none() -> None:
    items = [i for i in (generate_item(0, n, split="eval") for n in range(40)) if i["tool_should_be_used"]][:5]
    metrics = score(items, [_empty(i) for i in items])
    for key in ("tool_selection", "arg_match_strict", "arg_match_lax", "f1_strict_macro", "f1_lax_macro",
                "f1_strict_micro", "f1_lax_micro"):  # fmt: skip
        assert metrics[key] == 0.0 and isinstance(metrics[key], float), key
    assert metrics["json_validity"] is None  # no call emitted: undefined, not 0 and not 1
    assert metrics["ttfa_tokens_p50"] is None
    assert metrics["failure_reasons"] == {"wrong_call_count": 5}


def test_invalid_json_and_unknown_tool_and_reasons() -> None:
    item = _first("single")
    call = item["expected_calls"][0]
    bad_json = {"raw": '{"name": "get_wea', "call": None, "errors": ["malformed_call"], "fixture_hit": None}
    unknown = {"raw": "", "call": {"name": "launch_rocket", "arguments": {}}, "errors": [], "fixture_hit": False}
    outs = [{**_empty(item), "calls": [bad_json]}, {**_empty(item), "calls": [unknown]}]
    assert score([item], [outs[0]])["failure_reasons"] == {"invalid_json": 1}
    assert score([item], [outs[0]])["json_validity"] == 0.0
    assert score([item], [outs[1]])["failure_reasons"] == {"wrong_func_name": 1}
    name, args = call["name"], dict(call["arguments"])
    first_key = next(iter(args))
    assert match_call({"name": name, "arguments": {**args, "bogus": 1}}, call, lax=False) == "unexpected_param"
    assert match_call({"name": name, "arguments": {}}, call, lax=False) == "missing_required"
    assert match_call({"name": name, "arguments": {**args, first_key: [1]}}, call, lax=True) == "type_error"
    other = "get_weather" if name == "calculate" else "calculate"
    assert match_call({"name": other, "arguments": args}, call, lax=False) == "wrong_func_name"


def test_value_error_strict_vs_lax() -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert match_call({"name": "get_weather", "arguments": {"city": "paris"}}, call, lax=False) == "value_error"
    assert match_call({"name": "get_weather", "arguments": {"city": "paris"}}, call, lax=True) is None
    assert match_call({"name": "get_weather", "arguments": {"city": "Oslo"}}, call, lax=True) == "value_error"


def test_spans_and_grounding_precision() -> None:
    item = _first("single")
    out = reference_output(item)
    vocab_value = "snowy" if "snowy" not in out["answer"] else "cloudy"
    out["answer"] = out["answer"] + " Also 987654 and " + vocab_value
    metrics = score([item, _first("multi")], [out, reference_output(_first("multi"))])
    sliced = metrics["slices"]["kind"]["single"]
    assert 0.0 < sliced["f1_lax_macro"] < 1.0  # recall 1, precision < 1
    assert find_spans("Paris: 21 degrees on 2025-04-08", ["2025-04-08", "Paris"]) == ["2025-04-08", "Paris", "21"]


def test_no_spans_in_answer_scores_zero_f1() -> None:
    item = _first("single")
    out = reference_output(item)
    out["answer"] = "Done."
    metrics = score([item], [out])
    assert metrics["f1_strict_macro"] == 0.0 and metrics["f1_lax_micro"] == 0.0
    assert metrics["tool_selection"] == 1.0


def test_malformed_number_is_an_ungrounded_span_not_a_crash() -> None:
    assert parse_number("0.07.4") is None and parse_number("1.234,5", "de") == 1234.5
    item = _first("single")
    out = reference_output(item)
    out["answer"] = "It costs 0.07.4 now."
    metrics = score([item], [out])
    assert metrics["f1_lax_macro"] == 0.0


def test_german_decimal_comma_is_lax_grounded() -> None:
    item = _first("single")
    item["fixtures"][0]["result"] = {"amount": 21.5, "currency": "EUR"}
    item["integration_fields"] = ["21.5"]
    item["locale"] = "de"
    out = reference_output(item)
    out["answer"] = "Das sind 21,5 EUR."
    metrics = score([item], [out])
    assert metrics["f1_lax_macro"] == 1.0 and metrics["f1_strict_macro"] < 1.0


def test_missing_or_duplicate_outputs_rejected() -> None:
    items = [_first("single"), _first("control")]
    with pytest.raises(ValueError, match="missing"):
        score(items, [reference_output(items[0])])
    with pytest.raises(ValueError, match="duplicate"):
        score(items, [reference_output(items[0]), reference_output(items[0])])


def test_item_rows_are_what_the_aggregates_are_made_of() -> None:
    """The per-item rows the drift and quality gates read add up to the reported figures: the macro F1 is the mean
    of the eligible rows' F1, the rates are ratios of the rows' counts."""
    items = [generate_item(0, n, split="eval") for n in range(30)]
    outputs = [reference_output(i) if n % 3 else _empty(i) for n, i in enumerate(items)]
    metrics = score(items, outputs)
    rows = item_rows(score_items(items, outputs))
    assert [r["id"] for r in rows] == [str(i["id"]) for i in items]
    eligible = [r for r in rows if r["f1_lax"] is not None]
    assert eligible and len(eligible) < len(rows)  # control items carry no F1
    for mode in ("lax", "strict"):
        assert sum(r[f"f1_{mode}"] for r in eligible) / len(eligible) == pytest.approx(metrics[f"f1_{mode}_macro"])
    assert sum(r["selection_ok"] for r in rows) / len(rows) == pytest.approx(metrics["tool_selection"])
    valid, emitted = sum(r["calls_valid"] for r in rows), sum(r["calls_emitted"] for r in rows)
    assert valid / emitted == pytest.approx(metrics["json_validity"])
