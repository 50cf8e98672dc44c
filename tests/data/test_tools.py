"""Tools per item: which tools an item has, the shared validator on every JSON Schema type, the compact list."""

from __future__ import annotations

import pytest

from distillgates.data.chat import compact_tool_list, system_prompt
from distillgates.data.registry import TOOLS
from distillgates.data.tools import item_tools, tool_errors, validate_call

TOOL = {
    "name": "update_record",
    "parameters": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "active": {"type": "boolean"},
            "labels": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
            "owner": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]},
            "level": {"type": "string", "enum": ["low", "high"]},
            "note": {"type": ["string", "null"]},
            "score": {"type": "number"},
            "any": {},
        },
        "required": ["id", "active"],
        "additionalProperties": False,
    },
}


def _reasons(call) -> list[str]:
    return sorted(err.split(":", 1)[0] for err in validate_call(call, [TOOL]))


def call(**arguments):
    return {"name": "update_record", "arguments": {"id": 3, "active": True, **arguments}}


def test_an_item_without_tools_has_the_toy_registry():
    assert item_tools({"id": "x"}) == TOOLS
    assert item_tools({"tools": [TOOL]}) == [TOOL]
    assert validate_call({"name": "get_weather", "arguments": {"city": "Oslo"}}) == []
    assert _reasons({"name": "get_weather", "arguments": {"city": "Oslo"}}) == ["unknown_tool"]


@pytest.mark.parametrize(
    ("arguments", "reasons"),
    [
        ({"labels": ["a", "b"], "owner": {"email": "x@y.z"}, "level": "low", "note": None, "score": 1.5,
          "any": [1, {"x": 2}]}, []),
        ({"active": "true"}, ["type_error"]),  # a boolean is not a string
        ({"active": 1}, ["type_error"]),  # nor a number
        ({"id": True}, ["type_error"]),  # and an integer is not a boolean
        ({"labels": "a"}, ["type_error"]),
        ({"labels": ["c"]}, ["value_error"]),  # an enum inside an array
        ({"owner": {}}, ["missing_required"]),  # a nested object's required key
        ({"owner": {"email": 5}}, ["type_error"]),
        ({"level": "mid"}, ["value_error"]),
        ({"note": 3}, ["type_error"]),
        ({"extra": 1}, ["unexpected_param"]),
    ],
)  # fmt: skip
def test_validator_on_every_type(arguments, reasons):
    assert _reasons(call(**arguments)) == reasons


def test_compact_tool_list_names_every_type():
    assert compact_tool_list([TOOL]) == (
        "update_record(id:int,active:bool,labels?:list,owner?:obj,level?,note?,score?:num,any?:any)"
    )
    assert compact_tool_list() == compact_tool_list(TOOLS)  # the toy's prompt is unchanged
    assert system_prompt("en", [TOOL], intro="Be brief.") == f"Be brief. Tools: {compact_tool_list([TOOL])}"


@pytest.mark.parametrize(
    ("tool", "error"),
    [
        ("get_weather", "$: expected an object"),
        ({"parameters": {"type": "object"}}, "name: expected a non-empty string"),
        ({"name": "t", "parameters": {"type": "objekt"}}, "parameters.type: not a valid JSON Schema"),
        ({"name": "t", "parameters": {"type": "array", "items": {}}}, "parameters.type: expected 'object'"),
    ],
)
def test_tool_definitions_are_checked(tool, error):
    assert tool_errors(tool)[0].startswith(error)
