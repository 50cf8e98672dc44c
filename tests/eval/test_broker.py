"""Tool broker: normalized-argument replay, counted misses, conflicting fixtures."""

from __future__ import annotations

import pytest

from distillgates.eval.broker import ToolBroker

FIXTURES = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "result": {"temperature": 21}},
    {"name": "convert_currency", "arguments": {"amount": 100, "from_currency": "USD", "to_currency": "EUR"},
     "result": {"amount": 90.91, "currency": "EUR"}},
]  # fmt: skip


def test_hit_with_normalized_arguments() -> None:
    broker = ToolBroker(FIXTURES)
    result, hit, _ = broker.call("get_weather", {"unit": "Celsius", "city": "  paris "})
    assert hit and result == {"temperature": 21}
    result, hit, _ = broker.call("convert_currency", {"amount": 100.0, "from_currency": "usd", "to_currency": "EUR"})
    assert hit and result["amount"] == 90.91
    assert broker.stats.hits == 2 and broker.stats.misses == 0 and broker.stats.hit_rate == 1.0


def test_miss_returns_error_and_is_counted() -> None:
    broker = ToolBroker(FIXTURES)
    result, hit, _ = broker.call("get_weather", {"city": "Oslo"})
    assert not hit and "error" in result
    result, hit, _ = broker.call("no_such_tool", "not even a dict")
    assert not hit and "error" in result
    broker.call("get_weather", {"city": "Paris", "unit": "celsius"})
    assert broker.stats.misses == 2 and broker.stats.hits == 1
    assert broker.stats.hit_rate == pytest.approx(1 / 3)


def test_returned_result_is_a_copy() -> None:
    broker = ToolBroker(FIXTURES)
    result = broker.call("get_weather", {"city": "Paris", "unit": "celsius"}).result
    result["temperature"] = -99
    assert broker.call("get_weather", {"city": "Paris", "unit": "celsius"})[0] == {"temperature": 21}


def test_conflicting_fixtures_rejected() -> None:
    clash = {**FIXTURES[0], "arguments": {"city": "PARIS", "unit": "celsius"}, "result": {"temperature": 5}}
    with pytest.raises(ValueError, match="conflicting fixtures"):
        ToolBroker([FIXTURES[0], clash])


def test_empty_broker_hit_rate_is_none_not_zero() -> None:
    assert ToolBroker([]).stats.hit_rate is None
