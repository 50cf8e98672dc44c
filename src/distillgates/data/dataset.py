"""Dataset JSONL files: one header line, then one item per line; atomic writer, validating reader.

The header ties a file to what produced it (tokenizer, tool registry, prompt wrapper), so a model
is never trained or scored on data rendered for another tokenizer or registry. Every reader error
is a :class:`DatasetError` naming ``file:line`` and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distillgates.data.chat import LOCALES, prompt_wrapper_sha256
from distillgates.data.fingerprints import dataset_sha256
from distillgates.data.generator import KINDS
from distillgates.data.registry import tool_registry_sha256
from distillgates.data.tools import item_tools, tool_errors, tools_by_name, validate_call
from distillgates.io import atomic_write_text

DATASET_VERSION = 1

_ITEM_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "kind": str,
    "locale": str,
    "messages": list,
    "tool_should_be_used": bool,
    "expected_calls": list,
    "fixtures": list,
    "integration_fields": list,
    "pii": list,
    "reference": str,
}
_OPTIONAL_FIELDS: dict[str, type] = {"style": str, "tools": list, "instructions": str, "argument_alternatives": list,
                                     "optional_arguments": list, "parallel_calls": list}
_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_HEADER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "__header__": bool,
    "dataset_version": int,
    "tokenizer_fingerprint": str,
    "tool_registry_sha256": str,
    "seed": int,
    "shard": dict,
    "total": int,
    "prompt_wrapper_sha256": str,
}


TOP_UP = "eval_top_up"
"""Marks an eval item that ``data.eval_min_per_shape`` added (:func:`distillgates.data.build.top_up_eval`): it
powers the drift gates, and the quality figures leave it out (:func:`drawn_items`)."""


def drawn_items(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval items as drawn, without the top-up: the quality figures are over these (their shapes are the
    task's; the top-up's are a quota per shape)."""
    return [item for item in items if not item.get(TOP_UP)]


class DatasetError(ValueError):
    """A dataset file is malformed or does not match the expected fingerprints."""


def _fail(where: str, field: str, message: str) -> DatasetError:
    return DatasetError(f"{where}: {field}: {message}")


def decode_line(raw: bytes, where: str) -> str:
    """One line of a data file (``where``: ``file:line``) as text; a byte that is not UTF-8 raises
    :class:`DatasetError` naming the file, line and byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(where, "<utf-8>", f"byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line is not UTF-8 "
                                      "(save the file as UTF-8)") from err  # fmt: skip


def _check_fields(obj: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    for name, kind in fields.items():
        if name not in obj:
            raise _fail(where, name, "missing field")
        value = obj[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected = getattr(kind, "__name__", kind)
            raise _fail(where, name, f"expected {expected}, got {type(value).__name__} {value!r}")


def validate_item(item: Any, where: str = "<item>") -> None:
    """Check one item's fields, types and calls.

    Raises:
        DatasetError: naming ``where`` and the first bad field.
    """
    if not isinstance(item, dict):
        raise _fail(where, "<item>", f"expected a JSON object, got {type(item).__name__}")
    _check_fields(item, _ITEM_FIELDS, where)
    for name, kind in _OPTIONAL_FIELDS.items():
        if name in item and not isinstance(item[name], kind):
            raise _fail(where, name, f"expected {kind.__name__}, got {type(item[name]).__name__}")
    if not item["kind"]:
        raise _fail(where, "kind", f"expected a label such as one of {KINDS}, got an empty string")
    if item["locale"] not in LOCALES:
        raise _fail(where, "locale", f"expected one of {LOCALES}, got {item['locale']!r}")
    names = []
    for i, tool in enumerate(item.get("tools", [])):
        if errors := tool_errors(tool):
            field, message = errors[0].split(": ", 1)
            raise _fail(where, f"tools[{i}]" + ("" if field == "$" else f".{field}"), message)
        names.append(tool["name"])
    if len(set(names)) != len(names):
        raise _fail(where, "tools", f"duplicate tool names {sorted(n for n in set(names) if names.count(n) > 1)}")
    tools = item_tools(item)
    for i, message in enumerate(item["messages"]):
        if not (isinstance(message, dict) and message.get("role") in _MESSAGE_ROLES):
            raise _fail(where, f"messages[{i}].role", f"expected an object with role {'/'.join(_MESSAGE_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise _fail(where, f"messages[{i}].content", "expected a string")
        calls = message.get("tool_calls", [])
        if calls and (message["role"] != "assistant" or not isinstance(calls, list) or len(calls) != 1):
            raise _fail(where, f"messages[{i}].tool_calls", "expected one call, in an assistant message")
        for call in calls:
            if errors := validate_call(call, tools):
                raise _fail(where, f"messages[{i}].tool_calls[0]", "; ".join(errors))
    roles = [m["role"] for m in item["messages"]]
    if not roles or roles[-1] != "user":
        raise _fail(where, "messages", f"the prompt must end with a user message, got roles {roles}")
    for i, call in enumerate(item["expected_calls"]):
        errors = validate_call(call, tools)
        if errors:
            raise _fail(where, f"expected_calls[{i}]", "; ".join(errors))
    previous_end = 0
    for i, group in enumerate(item.get("parallel_calls", [])):
        ok = isinstance(group, list) and len(group) == 2 and all(type(v) is int for v in group)
        if not ok or not previous_end <= group[0] < group[1] - 1 < len(item["expected_calls"]):
            raise _fail(where, f"parallel_calls[{i}]", "expected [first, end) of 2+ expected calls, in order")
        previous_end = group[1]
    alternatives = item.get("argument_alternatives")
    if alternatives is not None:
        if len(alternatives) != len(item["expected_calls"]):
            raise _fail(where, "argument_alternatives", "expected one mapping per expected call")
        for i, alt in enumerate(alternatives):
            if not isinstance(alt, dict) or not all(isinstance(v, list) and v for v in alt.values()):
                raise _fail(where, f"argument_alternatives[{i}]", "expected {argument: [acceptable values]}")
    optional = item.get("optional_arguments")
    if optional is not None:
        if len(optional) != len(item["expected_calls"]):
            raise _fail(where, "optional_arguments", "expected one list per expected call")
        by_name = tools_by_name(tools)
        for i, (names, call) in enumerate(zip(optional, item["expected_calls"])):
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise _fail(where, f"optional_arguments[{i}]", "expected a list of argument names")
            params = by_name[call["name"]].get("parameters") or {}
            for name in names:
                if name not in params.get("properties", {}):
                    raise _fail(where, f"optional_arguments[{i}]", f"{name!r} is not a parameter of {call['name']}")
                if name in params.get("required", []):
                    raise _fail(where, f"optional_arguments[{i}]", f"{name!r} is required by {call['name']}'s schema")
    for i, fixture in enumerate(item["fixtures"]):
        if not isinstance(fixture, dict):
            raise _fail(where, f"fixtures[{i}]", "expected an object")
        _check_fields(fixture, {"name": str, "arguments": dict, "result": dict}, f"{where}: fixtures[{i}]")
    for name in ("integration_fields", "pii"):
        for i, value in enumerate(item[name]):
            if not isinstance(value, str):
                raise _fail(where, f"{name}[{i}]", f"expected str, got {type(value).__name__}")
    if item["tool_should_be_used"] != bool(item["expected_calls"]):
        raise _fail(where, "tool_should_be_used", "must be true exactly when expected_calls is non-empty")


def make_header(
    n_items: int, tokenizer_fingerprint: str, seed: int, shard_index: int = 0, shard_count: int = 1
) -> dict[str, Any]:
    """The header line of a dataset file with the current registry and wrapper fingerprints."""
    return {
        "__header__": True,
        "dataset_version": DATASET_VERSION,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "tool_registry_sha256": tool_registry_sha256(),
        "seed": seed,
        "shard": {"index": shard_index, "count": shard_count},
        "total": n_items,
        "prompt_wrapper_sha256": prompt_wrapper_sha256(),
    }


def write_dataset(
    path: str | Path,
    items: Sequence[dict[str, Any]],
    tokenizer_fingerprint: str,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
) -> str:
    """Validate ``items`` and write header + items atomically; returns :func:`dataset_sha256`."""
    for i, item in enumerate(items):
        validate_item(item, f"{path}:item[{i}]")
    ids = [item["id"] for item in items]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"{path}: id: duplicate item ids")
    header = make_header(len(items), tokenizer_fingerprint, seed, shard_index, shard_count)
    lines = [json.dumps(header, ensure_ascii=False)] + [json.dumps(item, ensure_ascii=False) for item in items]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return dataset_sha256(path)


def read_dataset(
    path: str | Path, tokenizer_fingerprint: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read and validate a dataset file.

    Args:
        path: the JSONL file.
        tokenizer_fingerprint: if given, the header must carry exactly this fingerprint.

    Returns:
        (header, items).

    Raises:
        DatasetError: ``file:line: field: problem`` for malformed JSON, a missing or mistyped
            field, a duplicate id, a wrong item count, or a header whose tokenizer, registry or
            prompt-wrapper fingerprint does not match.
    """
    path = Path(path)
    lines = path.read_bytes().splitlines()
    if not lines:
        raise DatasetError(f"{path}:1: __header__: file is empty")
    rows = []
    for number, raw in enumerate(lines, start=1):
        line = decode_line(raw, f"{path}:{number}")
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            message = f"malformed JSON line ({err.msg} at column {err.colno})"
            raise DatasetError(f"{path}:{number}: <json>: {message}") from err
    header = rows[0]
    where = f"{path}:1"
    if not isinstance(header, dict) or header.get("__header__") is not True:
        raise _fail(where, "__header__", "first line must be the header object with __header__: true")
    _check_fields(header, _HEADER_FIELDS, where)
    if header["dataset_version"] != DATASET_VERSION:
        raise _fail(where, "dataset_version", f"expected {DATASET_VERSION}, got {header['dataset_version']}")
    expected = {"tool_registry_sha256": tool_registry_sha256(), "prompt_wrapper_sha256": prompt_wrapper_sha256()}
    if tokenizer_fingerprint is not None:
        expected["tokenizer_fingerprint"] = tokenizer_fingerprint
    for name, value in expected.items():
        if header[name] != value:
            raise _fail(where, name, f"mismatch: file has {header[name][:12]}..., expected {value[:12]}...")
    items, seen = [], set()
    for number, item in enumerate(rows[1:], start=2):
        validate_item(item, f"{path}:{number}")
        if item["id"] in seen:
            raise _fail(f"{path}:{number}", "id", f"duplicate id {item['id']!r}")
        seen.add(item["id"])
        items.append(item)
    if header["total"] != len(items):
        raise _fail(where, "total", f"header says {header['total']} items, file has {len(items)}")
    return header, items
