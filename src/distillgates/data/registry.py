"""The toy tool registry: one JSON Schema per tool (the tools of every toy item).

Items of the user's own data carry their own tools; :mod:`distillgates.data.tools` decides which
tools an item has and holds the shared call validator.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from distillgates.config import sha256_json

CITIES = ("Paris", "London", "Berlin", "Madrid", "Oslo", "Tokyo", "Dublin", "Amsterdam")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF")
UNITS = ("celsius", "fahrenheit")
OPERATIONS = ("add", "subtract", "multiply", "divide")

TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1},
                "unit": {"type": "string", "enum": list(UNITS)},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount between currencies.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "from_currency": {"type": "string", "enum": list(CURRENCIES)},
                "to_currency": {"type": "string", "enum": list(CURRENCIES)},
            },
            "required": ["amount", "from_currency", "to_currency"],
            "additionalProperties": False,
        },
    },
    {
        "name": "search_documents",
        "description": "Search the document store.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
    {
        "name": "create_calendar_event",
        "description": "Create a calendar event.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1},
                "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                "time": {"type": "string", "pattern": r"^\d{2}:\d{2}$"},
            },
            "required": ["title", "date"],
            "additionalProperties": False,
        },
    },
    {
        "name": "calculate",
        "description": "Arithmetic on two numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "operation": {"type": "string", "enum": list(OPERATIONS)},
                "a": {"type": "number"},
                "b": {"type": "number"},
            },
            "required": ["operation", "a", "b"],
            "additionalProperties": False,
        },
    },
]
"""Tools in OpenAI function format (``name``, ``description``, ``parameters`` JSON Schema)."""

TOOLS_BY_NAME: dict[str, dict[str, Any]] = {t["name"]: t for t in TOOLS}
for _tool in TOOLS:
    Draft202012Validator.check_schema(_tool["parameters"])


def tool_registry_sha256() -> str:
    """sha256 of the canonical JSON of :data:`TOOLS` (a header field of every dataset)."""
    return sha256_json(TOOLS)
