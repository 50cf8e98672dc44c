"""Tool registry schemas and THE shared call validator."""

from __future__ import annotations

import pytest

from distillgates.data.registry import TOOLS, tool_registry_sha256
from distillgates.data.tools import REASONS, canonical_call, parse_tool_call, validate_call


def _reasons(call):
    return sorted(err.split(":", 1)[0] for err in validate_call(call))


def test_registry_has_the_five_tools_with_required_args():
    names = [tool["name"] for tool in TOOLS]
    assert names == ["get_weather", "convert_currency", "search_documents", "create_calendar_event", "calculate"]
    assert all(tool["parameters"]["required"] for tool in TOOLS)
    assert len(tool_registry_sha256()) == 64 and tool_registry_sha256() == tool_registry_sha256()


@pytest.mark.parametrize(
    ("call", "reasons"),
    [
        ({"name": "get_weather", "arguments": {"city": "Paris"}}, []),
        ({"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}, ["value_error"]),
        ({"name": "get_weather", "arguments": {}}, ["missing_required"]),
        ({"name": "get_weather", "arguments": {"city": "Oslo", "when": "now"}}, ["unexpected_param"]),
        ({"name": "calculate", "arguments": {"operation": "add", "a": "1", "b": 2}}, ["type_error"]),
        ({"name": "calculate", "arguments": {"operation": "add", "a": True, "b": 2}}, ["type_error"]),
        ({"name": "search_documents", "arguments": {"query": "x", "max_results": 2.5}}, ["type_error"]),
        ({"name": "search_documents", "arguments": {"query": "x", "max_results": 9}}, ["value_error"]),
        ({"name": "create_calendar_event", "arguments": {"title": "x", "date": "May 3"}}, ["value_error"]),
        ({"name": "send_email", "arguments": {}}, ["unknown_tool"]),
        ({"name": "get_weather"}, ["malformed_call"]),
        ({"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 1}, ["malformed_call"]),
        (["get_weather"], ["malformed_call"]),
    ],
)
def test_validate_call_reasons(call, reasons):
    assert _reasons(call) == reasons
    assert all(err.split(":", 1)[0] in REASONS for err in validate_call(call))


def test_parse_tool_call_round_trips_canonical_json():
    call = {"name": "convert_currency", "arguments": {"amount": 10, "from_currency": "EUR", "to_currency": "USD"}}
    text = canonical_call(call)
    assert text.startswith('{"name":"convert_currency","arguments":{')
    assert parse_tool_call(text) == call


@pytest.mark.parametrize(
    "text", ["", "{", "[]", '{"name":"x"}', '{"name":1,"arguments":{}}', '{"name":"x","arguments":[]}']
)
def test_parse_tool_call_rejects_non_calls(text):
    assert parse_tool_call(text) is None
