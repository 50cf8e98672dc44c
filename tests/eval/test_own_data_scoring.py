"""The scorer and the broker on the user's own tools: per-item tools, privacy allow-list and PII patterns,
BFCL-style acceptable alternatives, the missing-fixture policy, control/decline from explicit labels."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from distillgates.config import PrivacyConfig
from distillgates.data.chat import tool_call_text, toy_chat_format
from distillgates.data.openai_format import row_to_item
from distillgates.eval.broker import FixturePolicy, ToolBroker
from distillgates.eval.runners import Turn, eval_prompt_item, reference_output, run_item
from distillgates.eval.scorer import score

from ..conftest import own_data_rows

ALLOW_EMAIL = PrivacyConfig(allow=["create_ticket.reporter"])


@pytest.fixture
def items() -> dict[str, dict[str, Any]]:
    return {row["id"]: row_to_item(row, f"rows.jsonl:{i + 1}", "x") for i, row in enumerate(own_data_rows())}


class _Replay:
    """A session that plays fixed assistant turns (text before the stop token)."""

    chat_format = toy_chat_format()

    def __init__(self, turns: Sequence[str]) -> None:
        self.turns = iter(turns)

    def first_turn(self, item: Mapping[str, Any], prompt_text: str) -> Turn:
        return self.next_turn([])

    def next_turn(self, results: list[dict[str, Any]]) -> Turn:
        return Turn(text=next(self.turns), tokens=1, stopped=True)


def replay(item: Mapping[str, Any], turns: Sequence[str], policy: FixturePolicy | None = None) -> dict[str, Any]:
    return run_item(item, _Replay(turns), max_calls=len(turns), policy=policy)


def call_turn(name: str, **arguments: Any) -> str:
    return tool_call_text({"name": name, "arguments": arguments}).removesuffix("<|end|>")


def test_prompt_lists_the_items_own_tools_never_the_toy_registry(items):
    for item in items.values():
        system = eval_prompt_item(item)["messages"][0]["content"]
        assert "create_ticket(" in system and "search_files(" in system and "get_weather" not in system


def test_reference_outputs_score_perfect_on_own_tools(items):
    outputs = [reference_output(item) for item in items.values()]
    metrics = score(list(items.values()), outputs, privacy=ALLOW_EMAIL)
    for key in ("tool_selection", "json_validity", "arg_match_strict", "arg_match_lax", "fixture_hit_rate",
                "privacy_ok_rate"):  # fmt: skip
        assert metrics[key] == 1.0, key
    assert metrics["controls_with_integration"] == 0 and metrics["mocked_calls"] == 0
    assert metrics["f1_lax_macro"] == 1.0


def test_privacy_allow_list_per_field_and_per_tool(items):
    item = items["multiturn-0"]  # the expected call carries the user's email in create_ticket.reporter
    output = reference_output(item)
    assert score([item], [output])["privacy_ok_rate"] == 0.0  # without an allow-list: a leak
    assert score([item], [output], privacy=ALLOW_EMAIL)["privacy_ok_rate"] == 1.0
    assert score([item], [output], privacy=PrivacyConfig(allow=["create_ticket"]))["privacy_ok_rate"] == 1.0
    other_field = PrivacyConfig(allow=["create_ticket.title", "search_files"])
    assert score([item], [output], privacy=other_field)["privacy_ok_rate"] == 0.0
    echoed = copy.deepcopy(output)
    echoed["answer"] = "Your ticket is T-1042, anna0@example.com."  # the answer is always checked
    assert score([item], [echoed], privacy=ALLOW_EMAIL)["privacy_ok_rate"] == 0.0


def test_pii_patterns_are_configurable(items):
    item = copy.deepcopy(items["control-0"])
    item["messages"][-1]["content"] = "I am employee EMP-77. What does VPN stand for?"
    output = replay(item, ["Virtual private network, EMP-77."])
    assert score([item], [output])["privacy_ok_rate"] == 1.0  # the default patterns do not know this id
    patterns = {**PrivacyConfig().pii_patterns, "employee": r"\bEMP-\d+\b"}
    assert score([item], [output], privacy=PrivacyConfig(pii_patterns=patterns))["privacy_ok_rate"] == 0.0
    with pytest.raises(ValueError, match=r"pii_patterns\.bad"):
        PrivacyConfig(pii_patterns={"bad": "(unclosed"})


def test_acceptable_alternatives_match_and_hit_the_fixture(items):
    item = items["parallel-0"]
    ticket = call_turn("create_ticket", title="printer 0 jams", priority="low")
    answer = "Ticket T-1041 is filed; the manual is docs/printer-manual.pdf."
    for query, matches in (("printer handbook", True), ("Printer Guide", None), ("toner", False)):
        output = replay(item, [ticket, call_turn("search_files", query=query, max_results=1), answer])
        metrics = score([item], [output])
        assert metrics["arg_match_lax"] == (1.0 if matches is not False else 0.0), query
        assert metrics["arg_match_strict"] == (1.0 if matches else 0.0), query  # strict: exact text only
        assert metrics["fixture_hit_rate"] == (1.0 if matches is not False else 0.5), query
        assert output["turns"][3]["result"] == ({"path": "docs/printer-manual.pdf"} if matches is not False
                                                else {"error": "no result for tool 'search_files' with these "
                                                      "arguments"})  # fmt: skip


def test_missing_fixture_policy_error_or_counted_mock(items):
    item = items["single-0"]
    wrong = call_turn("create_ticket", title="something else", priority="low")
    error = replay(item, [wrong, "Done."])
    assert "error" in error["turns"][1]["result"] and "mocked" not in error["calls"][0]
    mocked = replay(item, [wrong, "Done."], FixturePolicy("mock", {"ticket_id": "MOCK"}))
    assert mocked["turns"][1]["result"] == {"ticket_id": "MOCK"} and mocked["calls"][0]["mocked"] is True
    assert mocked["calls"][0]["fixture_hit"] is False
    metrics = score([item], [mocked])
    assert metrics["mocked_calls"] == 1 and metrics["fixture_hit_rate"] == 0.0  # a mock is never a hit
    assert score([item], [error])["mocked_calls"] == 0
    broker = ToolBroker.for_item(item, FixturePolicy("mock"))
    broker.call("create_ticket", {"title": "x", "priority": "low"})
    assert (broker.stats.hits, broker.stats.misses, broker.stats.mocked) == (0, 1, 1)
    with pytest.raises(ValueError, match="missing_fixture"):
        FixturePolicy("ignore")


def test_control_metrics_come_from_explicit_labels(items):
    call = call_turn("search_files", query="VPN")
    labeled, unlabeled = items["control-0"], items["chat-0"]
    outputs = [replay(labeled, [call, "Virtual private network."]), replay(unlabeled, [call, "You are welcome."])]
    metrics = score([labeled, unlabeled], outputs)
    assert metrics["controls_with_integration"] == 1  # only the labeled control counts
    assert metrics["false_tool_calls_tool_absent"] == 2  # both needed no tool


def test_calls_validate_against_the_items_tools_not_the_registry(items):
    item = items["chat-0"]
    toy_call = call_turn("get_weather", city="Paris")
    output = replay(item, [toy_call, "You are welcome."])
    assert output["calls"][0]["errors"][0].startswith("unknown_tool")
    assert score([item], [output])["json_validity"] == 0.0
    typed = replay(item, [call_turn("create_ticket", title="x", priority="low", urgent="yes"), "Ok."])
    assert typed["calls"][0]["errors"][0].startswith("type_error: arguments.urgent")


def test_calls_of_one_parallel_turn_may_come_in_any_order(items):
    item = items["parallel-0"]
    assert item["parallel_calls"] == [[0, 2]]
    ticket = call_turn("create_ticket", title="printer 0 jams", priority="low")
    search = call_turn("search_files", query="printer manual", max_results=1)
    answer = "Ticket T-1041 is filed; the manual is docs/printer-manual.pdf."
    swapped = replay(item, [search, ticket, answer])
    metrics = score([item], [swapped])
    assert metrics["tool_selection"] == metrics["arg_match_strict"] == metrics["fixture_hit_rate"] == 1.0
    sequential = {**item, "parallel_calls": []}  # the same calls in two turns: order matters
    metrics = score([sequential], [swapped])
    assert metrics["tool_selection"] == 0.0 and metrics["failure_reasons"] == {"wrong_func_name": 1}
    twice = replay(item, [search, search, answer])  # a call twice is not the pair, in any order
    assert score([item], [twice])["tool_selection"] == 0.0
