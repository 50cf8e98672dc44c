"""The argument matcher against BFCL's reference semantics: properties (hypothesis) and one regression test per
class of wrong verdict found on real function-calling data (issue 30: classes 1-5 here; 6-9 below and in
tests/data/test_openai_format.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from distillgates.data.generator import generate_item
from distillgates.eval.matching import match_call, values_equal_lax
from distillgates.eval.runners import reference_output
from distillgates.eval.scorer import score, score_items

TOOL = {"name": "book", "parameters": {"type": "object", "required": ["year"], "properties": {
    "year": {"type": "integer"}, "x": {"type": "number"}, "code": {"type": "string"}, "city": {"type": "string"},
    "unit": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "flag": {}}}}  # fmt: skip


def _item(expected: list[dict[str, Any]], parallel: bool = True, **extra: Any) -> dict[str, Any]:
    return {"id": "i", "kind": "multi", "locale": "en", "tools": [TOOL], "tool_should_be_used": True,
            "messages": [{"role": "user", "content": "Book these."}], "expected_calls": expected, "fixtures": [],
            "integration_fields": [], "pii": [], **({"parallel_calls": [[0, len(expected)]]} if parallel and
                                                     len(expected) > 1 else {}), **extra}  # fmt: skip


def _output(calls: list[Any], answer: str = "", results: list[Any] | None = None) -> dict[str, Any]:
    records = [{"raw": "", "call": c, "errors": [], "fixture_hit": results is not None} for c in calls]
    turns = [{"role": "tool", "result": r} for r in results or []]
    return {"id": "i", "calls": records, "turns": turns, "answer": answer, "tokens_out": 0, "ttfa_tokens": None}


def _verdicts(expected: list[dict[str, Any]], emitted: list[Any], **extra: Any) -> tuple[str | None, str | None]:
    (item_score,) = score_items([_item(expected, **extra)], [_output(emitted)])
    return item_score.arg_strict, item_score.arg_lax


def _call(**arguments: Any) -> dict[str, Any]:
    return {"name": "book", "arguments": arguments}


calls_strategy = st.lists(st.fixed_dictionaries({
    "year": st.integers(1900, 2100), "x": st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-100, 100),
    "code": st.from_regex(r"\d{1,9}", fullmatch=True), "city": st.sampled_from(["Paris", "paris", "PARIS", "Oslo"]),
    "flag": st.booleans()}),
    min_size=1, max_size=12).map(lambda args: [_call(**a) for a in args])  # fmt: skip


# --------------------------------------------------------------------------------------
# Properties


@settings(max_examples=60, deadline=None)
@given(calls_strategy, st.data())
def test_any_permutation_of_a_correct_call_set_is_correct_in_both_modes(expected, data) -> None:
    order = data.draw(st.permutations(range(len(expected))))
    strict, lax = _verdicts(expected, [expected[i] for i in order])
    assert strict is None and lax is None


def _perturb(value: Any, how: int) -> Any:
    if isinstance(value, bool):
        return [value, int(value), not value, value, value][how % 5]  # True == 1 in Python, not in JSON
    if value is None:
        return value
    if isinstance(value, int | float):
        return [value, value * 1.004, value + 1, value * 1.05, float(value)][how % 5]
    if isinstance(value, str):
        return [value, value.upper(), f" {value}.", value + "1", value[::-1]][how % 5]
    if isinstance(value, list):
        return [_perturb(v, how) for v in value]
    if isinstance(value, dict):
        return {k: _perturb(v, how) for k, v in value.items()}
    return value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**7, 10**7) | st.floats(-1e9, 1e9, allow_nan=False)
    | st.text("aAbB1 2.,-", max_size=8) | st.from_regex(r"\d{1,8}", fullmatch=True),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from("ab"), children, max_size=2),
    max_leaves=6)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(0, 4), st.sampled_from([None, {"type": "integer"}, {"type": "number"}]))
def test_lax_equality_is_symmetric(value, how, schema) -> None:
    other = _perturb(value, how)
    assert values_equal_lax(value, other, schema) == values_equal_lax(other, value, schema)


@settings(max_examples=60, deadline=None)
@given(calls_strategy, st.lists(st.integers(0, 4), min_size=12, max_size=12), st.data())
def test_strict_correct_implies_lax_correct(expected, hows, data) -> None:
    emitted = [_call(**{k: _perturb(v, h) for k, v in c["arguments"].items()}) for c, h in zip(expected, hows)]
    emitted = [emitted[i] for i in data.draw(st.permutations(range(len(emitted))))]
    for parallel in (True, False):
        strict, lax = _verdicts(expected, emitted, parallel=parallel)
        assert strict is not None or lax is None
    for got, want in zip(emitted, expected):
        strict_call, lax_call = (match_call(got, want, lax=lax, tools=[TOOL]) for lax in (False, True))
        assert strict_call is not None or lax_call is None


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**9, 10**9), st.integers(-10**6, 10**6).filter(bool), st.sampled_from(["year", "x"]))
def test_a_changed_integer_argument_is_never_lax_correct(value, delta, name) -> None:
    want = _call(**{"year": 2000, name: value})
    got = _call(**{"year": 2000, name: value + delta})
    assert match_call(got, want, lax=True, tools=[TOOL]) == "value_error"


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"\d{1,12}", fullmatch=True), st.data())
def test_a_changed_digit_string_is_never_lax_correct(code, data) -> None:
    i = data.draw(st.integers(0, len(code) - 1))
    digit = data.draw(st.sampled_from([d for d in "0123456789" if d != code[i]]))
    changed = code[:i] + digit + code[i + 1:]
    assert match_call(_call(year=1, code=changed), _call(year=1, code=code), lax=True, tools=[TOOL]) == "value_error"


# --------------------------------------------------------------------------------------
# One regression test per class (each failed before the fix)


def test_1_strict_pairs_parallel_calls_with_its_own_matching() -> None:
    """Lax-equal calls (2019 ~ 2018 within 1% then; "AA" ~ "Aa" after case folding) in another order were
    paired by lax matching, so an exactly right set failed strict."""
    expected = [_call(year=2019, x=1.5), _call(year=2018, x=1.5)]
    assert _verdicts(expected, expected[::-1]) == (None, None)
    expected = [_call(year=1, code="AA"), _call(year=1, code="Aa")]
    assert _verdicts(expected, expected[::-1]) == (None, None)


def test_2_more_than_six_parallel_calls_are_paired() -> None:
    expected = [_call(year=2000 + i, city=f"city {i}") for i in range(8)]
    assert _verdicts(expected, expected[::-1]) == (None, None)
    metrics = score([_item(expected)], [_output(expected[::-1])])
    assert metrics["tool_selection"] == 1.0 and metrics["arg_match_strict"] == 1.0


def test_3_tiny_numbers_are_not_all_equal() -> None:
    for want, got in ((1e-9, 2e-9), (8.854e-12, 1.77e-11)):
        assert match_call(_call(year=1, x=got), _call(year=1, x=want), lax=True, tools=[TOOL]) == "value_error"
    assert match_call(_call(year=1, x=8.86e-12), _call(year=1, x=8.854e-12), lax=True, tools=[TOOL]) is None


def test_4_normalisation_is_the_same_on_both_sides() -> None:
    assert match_call(_call(year=1, code="123456."), _call(year=1, code="123456"), lax=True, tools=[TOOL]) is None
    assert match_call(_call(year=1, code="123456"), _call(year=1, code="123456."), lax=True, tools=[TOOL]) is None
    assert match_call(_call(year=1, code="123456."), _call(year=1, code="123456"), lax=False, tools=[TOOL])


def test_5_no_numeric_tolerance_on_integers_or_identifiers() -> None:
    for got, want in ((dict(year=2020), dict(year=2019)), (dict(year=1, code="987655"), dict(year=1, code="987654")),
                      (dict(year=1, x=451), dict(year=1, x=450)), (dict(year=1, x=450.5), dict(year=1, x=450))):
        assert match_call(_call(**got), _call(**want), lax=True, tools=[TOOL]) == "value_error", got
    assert match_call(_call(year=1, x=2.504), _call(year=1, x=2.5), lax=True, tools=[TOOL]) is None  # non-integers: 1%
    assert match_call(_call(year=1, x=2.504), _call(year=1, x=2.5), lax=False, tools=[TOOL]) == "value_error"


def test_6_optional_arguments_may_be_given_or_left_out() -> None:
    with_unit, without = _call(year=1, unit="celsius"), _call(year=1)
    optional = [["unit"]]
    assert _verdicts([with_unit], [without], optional_arguments=optional) == (None, None)
    assert _verdicts([without], [with_unit], optional_arguments=optional) == (None, None)
    assert _verdicts([without], [with_unit]) == ("unexpected_param", "unexpected_param")  # not declared: still wrong
    assert _verdicts([with_unit], [without]) == ("value_error", "value_error")
    # given, it must match the expected value or, when the reference leaves it out, a listed alternative
    assert _verdicts([with_unit], [_call(year=1, unit="kelvin")], optional_arguments=optional)[1] == "value_error"
    listed = {"optional_arguments": optional, "argument_alternatives": [{"unit": ["celsius"]}]}
    assert _verdicts([without], [_call(year=1, unit="Celsius")], **listed) == ("value_error", None)
    assert _verdicts([without], [_call(year=1, unit="kelvin")], **listed)[1] == "value_error"


# --------------------------------------------------------------------------------------
# Class 9: integration F1 is grounded only in tool results the model received


def _tool_item(kind: str = "single", tool: str | None = None) -> dict[str, Any]:
    items = (generate_item(0, n, split="eval") for n in range(500))
    return next(i for i in items if i["kind"] == kind and tool in (None, *(c["name"] for c in i["expected_calls"])))


def test_9_a_model_that_makes_no_call_scores_no_integration() -> None:
    item = _tool_item()
    user = item["messages"][-1]["content"]
    echo = {**reference_output(item), "calls": [], "turns": [], "answer": f"{user} " + " ".join(
        str(v) for c in item["expected_calls"] for v in c["arguments"].values())}  # fmt: skip
    metrics = score([item], [echo])
    assert metrics["f1_lax_macro"] == 0.0 and metrics["f1_strict_macro"] == 0.0 and metrics["f1_lax_micro"] == 0.0
    guessed = {**echo, "answer": reference_output(item)["answer"]}  # the right facts, but no tool result received
    assert score([item], [guessed])["f1_lax_macro"] == 0.0
    assert score([item], [reference_output(item)])["f1_lax_macro"] == 1.0


def test_9_echoing_the_request_is_no_span_and_a_result_repeated_beyond_it_is() -> None:
    item = _item([_call(year=24, x=12)])
    item["messages"][0]["content"] = "Calculate 24 minus 12."
    out = _output([_call(year=24, x=12)], answer="24 minus 12 = 12.", results=[{"result": 12}])
    (item_score,) = score_items([item], [out])
    assert (item_score.spans, item_score.grounded_strict, item_score.grounded_lax) == (1, 1, 1)
    out["answer"] = "24 minus 12 is what you asked."
    (item_score,) = score_items([item], [out])
    assert (item_score.spans, item_score.grounded_lax) == (0, 0)


def test_9_a_control_answer_that_repeats_its_own_question_is_no_integration() -> None:
    control, single = _tool_item("control"), _tool_item("single", "get_weather")
    value = next(v for v in single["fixtures"][0]["result"].values() if isinstance(v, str) and len(v) >= 3)
    control["messages"][-1]["content"] = f"Is {value} a nice word?"
    out = {**reference_output(control), "answer": f"Yes, {value} is a nice word."}
    assert score([control, single], [out, reference_output(single)])["controls_with_integration"] == 0
