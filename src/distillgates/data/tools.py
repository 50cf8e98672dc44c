"""The tools of an item and THE shared call validator.

Every item carries the tools its conversation may use, in OpenAI function format (``name``,
``description``, ``parameters`` JSON Schema); a toy item without a ``tools`` field uses the toy
registry (:data:`distillgates.data.registry.TOOLS`). :func:`item_tools` is the one place that
decides which tools an item has, so the validator, the scorer, constrained decoding, the tool
broker and the system prompt all see the same list.

:func:`validate_call` is the single definition of a valid tool call: the scorer (JSON validity,
argument match reasons), the training losses, the data reader and constrained decoding all call it,
so "valid" means the same thing everywhere. Each error string starts with a reason code from
:data:`REASONS` (``"<reason>: <path>: <message>"``) so callers can count failures by reason.
Any JSON Schema (draft 2020-12, which covers what the OpenAI format allows) validates here;
only constrained decoding supports a subset (see :mod:`distillgates.runtime.constrained`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from distillgates.data.registry import TOOLS

REASONS = ("malformed_call", "unknown_tool", "missing_required", "unexpected_param", "type_error", "value_error")
"""Reason codes that prefix every :func:`validate_call` error."""

_REASON_BY_KEYWORD = {"required": "missing_required", "additionalProperties": "unexpected_param", "type": "type_error"}

Tools = Sequence[Mapping[str, Any]]


def item_tools(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tools of ``item``: its own ``tools`` list, or the toy registry when it has none."""
    tools = item.get("tools")
    return [dict(t) for t in (TOOLS if tools is None else tools)]


def tools_by_name(tools: Tools | None = None) -> dict[str, dict[str, Any]]:
    return {str(t["name"]): dict(t) for t in (TOOLS if tools is None else tools)}


def tool_errors(tool: Any) -> list[str]:
    """Problems of one tool definition (flat OpenAI function format) as ``"<field>: <message>"``
    (``$``: the tool itself); ``[]`` means usable.

    ``parameters`` must be a valid JSON Schema (draft 2020-12) of type object; a tool without
    ``parameters`` takes no arguments.
    """
    if not isinstance(tool, Mapping):
        return [f"$: expected an object, got {type(tool).__name__}"]
    return list(_tool_errors(json.dumps(tool, sort_keys=True, ensure_ascii=False)))


@lru_cache(maxsize=1024)  # every item of a dataset usually repeats the same few tools
def _tool_errors(tool_json: str) -> tuple[str, ...]:
    tool = json.loads(tool_json)
    errors = []
    if not isinstance(tool.get("name"), str) or not tool.get("name"):
        errors.append("name: expected a non-empty string")
    if "description" in tool and not isinstance(tool["description"], str):
        errors.append("description: expected a string")
    params = tool.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        return (*errors, f"parameters: expected a JSON Schema object, got {type(params).__name__}")
    try:
        Draft202012Validator.check_schema(dict(params))
    except SchemaError as err:
        where = ".".join(["parameters", *map(str, err.absolute_path)])
        errors.append(f"{where}: not a valid JSON Schema: {err.message}")
    if params.get("type", "object") != "object":
        errors.append(f"parameters.type: expected 'object', got {params.get('type')!r}")
    return tuple(errors)


@lru_cache(maxsize=256)
def _validators(tools_json: str) -> dict[str, Draft202012Validator]:
    tools = json.loads(tools_json)
    return {t["name"]: Draft202012Validator(t.get("parameters", {"type": "object"})) for t in tools}


def _tools_key(tools: Tools | None) -> str:
    return json.dumps(list(TOOLS if tools is None else tools), sort_keys=True, ensure_ascii=False)


def validate_call(call: Any, tools: Tools | None = None) -> list[str]:
    """Errors of one tool call ``{"name": str, "arguments": {...}}`` against ``tools``; ``[]`` means valid.

    Args:
        call: the parsed call.
        tools: the item's tools (:func:`item_tools`); ``None``: the toy registry.

    Each error is ``"<reason>: <path>: <message>"`` with reason in :data:`REASONS`. A name that is
    not among ``tools`` is an error. Booleans are not numbers here (JSON Schema already says so).
    """
    if not isinstance(call, dict):
        return [f"malformed_call: $: expected an object, got {type(call).__name__}"]
    validators = _validators(_tools_key(tools))
    errors = []
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        errors.append(f"malformed_call: $: unexpected key(s) {extra}")
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str):
        errors.append(f"malformed_call: name: expected a string, got {type(name).__name__}")
    elif name not in validators:
        errors.append(f"unknown_tool: name: {name!r} is not among the tools ({', '.join(validators)})")
    if not isinstance(arguments, dict):
        errors.append(f"malformed_call: arguments: expected an object, got {type(arguments).__name__}")
    if errors:
        return errors
    for err in sorted(validators[str(name)].iter_errors(arguments), key=lambda e: list(e.absolute_path)):
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


def canonical_call(call: Mapping[str, Any]) -> str:
    """The canonical tool-call JSON of the chat format: keys ``name`` then ``arguments``, compact."""
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, separators=(",", ":"), ensure_ascii=False)
