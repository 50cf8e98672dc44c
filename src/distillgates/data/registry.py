"""The toy tool registry: one JSON Schema per tool, and THE shared call validator.

:func:`validate_call` is the single definition of a valid tool call: the scorer (JSON validity,
argument match reasons), the training losses and constrained decoding all call it, so "valid"
means the same thing everywhere. Each error string starts with a reason code from
:data:`REASONS` (``"<reason>: <path>: <message>"``) so callers can count failures by reason.
"""

from __future__ import annotations

import json
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
_VALIDATORS = {t["name"]: Draft202012Validator(t["parameters"]) for t in TOOLS}
for _tool in TOOLS:
    Draft202012Validator.check_schema(_tool["parameters"])

REASONS = ("malformed_call", "unknown_tool", "missing_required", "unexpected_param", "type_error", "value_error")
"""Reason codes that prefix every :func:`validate_call` error."""

_REASON_BY_KEYWORD = {"required": "missing_required", "additionalProperties": "unexpected_param", "type": "type_error"}


def tool_registry_sha256() -> str:
    """sha256 of the canonical JSON of :data:`TOOLS` (a header field of every dataset)."""
    return sha256_json(TOOLS)


def validate_call(call: Any) -> list[str]:
    """Errors of one tool call ``{"name": str, "arguments": {...}}``; ``[]`` means valid.

    Each error is ``"<reason>: <path>: <message>"`` with reason in :data:`REASONS`. An unknown
    tool name is an error. Booleans are not numbers here (JSON Schema already says so).
    """
    if not isinstance(call, dict):
        return [f"malformed_call: $: expected an object, got {type(call).__name__}"]
    errors = []
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        errors.append(f"malformed_call: $: unexpected key(s) {extra}")
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str):
        errors.append(f"malformed_call: name: expected a string, got {type(name).__name__}")
    elif name not in _VALIDATORS:
        errors.append(f"unknown_tool: name: {name!r} is not in the registry ({', '.join(TOOLS_BY_NAME)})")
    if not isinstance(arguments, dict):
        errors.append(f"malformed_call: arguments: expected an object, got {type(arguments).__name__}")
    if errors:
        return errors
    for err in sorted(_VALIDATORS[name].iter_errors(arguments), key=lambda e: list(e.absolute_path)):
        reason = _REASON_BY_KEYWORD.get(str(err.validator), "value_error")
        path = ".".join(["arguments", *map(str, err.absolute_path)])
        errors.append(f"{reason}: {path}: {err.message}")
    return errors


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """Parse tool-call JSON text into ``{"name", "arguments"}``; ``None`` if not such an object.

    Only the shape is checked here (an object with a string ``name`` and an object
    ``arguments``, nothing else); schema validity is :func:`validate_call`'s job.
    """
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return None
    if not isinstance(call["name"], str) or not isinstance(call["arguments"], dict):
        return None
    return call


def canonical_call(call: dict[str, Any]) -> str:
    """The canonical tool-call JSON of the chat format: keys ``name`` then ``arguments``, compact."""
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, separators=(",", ":"), ensure_ascii=False)
