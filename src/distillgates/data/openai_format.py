"""Datasets in the OpenAI chat format: JSONL files or Hugging Face ``datasets``, rows -> internal items.

A row (one JSON object per line)::

    {"messages": [
        {"role": "system", "content": "You file support tickets."},                      # optional
        {"role": "user", "content": "Open a ticket: login fails, and find the runbook."},
        {"role": "assistant", "content": null, "tool_calls": [                            # parallel calls
            {"id": "c1", "type": "function",
             "function": {"name": "create_ticket", "arguments": "{\"title\": \"login fails\"}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "search_files", "arguments": "{\"query\": \"runbook\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"ticket_id\": \"T-7\"}"},
        {"role": "tool", "tool_call_id": "c2", "content": "{\"path\": \"ops/runbook.md\"}"},
        {"role": "assistant", "content": "Ticket T-7 is open; the runbook is ops/runbook.md."}],
     "tools": [{"type": "function", "function": {"name": "create_ticket", "parameters": {...}}}, ...],
     "id": "...", "kind": "control", "pii": ["..."], "locale": "en",                       # all optional
     "argument_alternatives": {"c2": {"query": ["runbook", "login runbook"]}},
     "optional_arguments": {"c2": ["max_results"]}}                                       # may be given or left out

Conversion (:func:`row_to_item`):

- the turns after the **last user message** are the target: its assistant ``tool_calls`` are the
  expected calls (in order), each call's ``tool`` message (by ``tool_call_id``) its fixture
  result, and the final assistant message the answer; everything before is the prompt (earlier
  turns are history the model reads). The target must end with an assistant answer.
- parallel calls are interleaved with their results (call 1, result 1, call 2, result 2), the
  order the runtime plays a conversation in; the expected calls keep the row's order, and the
  item's ``parallel_calls`` (``[first, end)`` per parallel turn) lets the scorer accept them in any order.
- a tool result that is a JSON object is used as is; any other content becomes ``{"content": text}``.
- the row's system message becomes the item's ``instructions`` (the system prompt then lists the
  row's tools after it); ``tools`` accepts the OpenAI ``{"type": "function", "function": {...}}``
  wrapper or the flat ``{"name", "description", "parameters"}`` form, or a JSON string of either.
- the row's tools are checked first (each ``parameters`` a valid JSON Schema of type object), before any
  call is read; ``map_types`` (``data.map_schema_types``) first maps the :data:`NONSTANDARD_TYPES` of
  real-world function schemas (``dict``, ``float``, ``tuple``, ``any``) to JSON Schema.
- labels: ``kind`` ``control`` (needs no tool) or ``decline`` (must refuse) feed the control/decline
  metrics; unlabeled rows are ``single`` / ``multi`` / ``no_tool`` by their number of calls, and
  are never counted as controls. ``pii`` lists strings the output must not repeat.

Every problem raises :class:`~distillgates.data.dataset.DatasetError` naming ``file:line`` and the
field (``messages[3].tool_calls[0].function.arguments``); :func:`read_items` can instead skip such
rows and list them (``data.invalid_rows: skip``). Nothing is written here: the data step writes the
converted splits atomically (:mod:`distillgates.data.build`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from distillgates.data.chat import LOCALES, answer_text, item_system_prompt, tool_call_text, tool_result_text
from distillgates.data.dataset import DatasetError, decode_line, validate_item
from distillgates.data.tools import tool_errors, validate_call

_ROW_FIELDS = {"id", "messages", "tools", "kind", "pii", "locale", "argument_alternatives", "optional_arguments",
               "integration_fields"}
NONSTANDARD_TYPES: dict[str, str | None] = {"dict": "object", "float": "number", "tuple": "array", "any": None}
"""Types of real-world function schemas that are not JSON Schema, and their JSON Schema type (``None``: no
constraint); applied only with ``data.map_schema_types``."""


def _fail(where: str, field: str, message: str) -> DatasetError:
    return DatasetError(f"{where}: {field}: {message}")


def _json_field(value: Any, where: str, field: str) -> Any:
    """A field given as a JSON string (Parquet/Arrow-friendly) or as the value itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise _fail(where, field, f"not valid JSON ({err.msg} at column {err.colno})") from err


def _content(message: Mapping[str, Any], where: str, field: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise _fail(where, field, f"expected a string or a list of text parts, got {type(content).__name__}")


def map_schema_types(schema: Any) -> Any:
    """``schema`` with the :data:`NONSTANDARD_TYPES` replaced, in every nested schema (``type`` values only)."""
    if isinstance(schema, list):
        return [map_schema_types(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: map_schema_types(v) for k, v in schema.items() if k != "type"}
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        mapped = [NONSTANDARD_TYPES.get(k, k) if isinstance(k, str) else k for k in kinds]
        if None not in mapped:  # "any" anywhere: no type constraint
            out["type"] = mapped if isinstance(schema["type"], list) else mapped[0]
    return out


def _tools(row: Mapping[str, Any], where: str, map_types: bool = False) -> list[dict[str, Any]]:
    """The row's tools, flat, each checked (a valid JSON Schema of type object) before any call is read."""
    raw = _json_field(row.get("tools", []), where, "tools")
    if not isinstance(raw, list):
        raise _fail(where, "tools", f"expected a list of tools, got {type(raw).__name__}")
    tools = []
    for i, tool in enumerate(raw):
        if isinstance(tool, Mapping) and "function" in tool:
            if tool.get("type", "function") != "function":
                raise _fail(where, f"tools[{i}].type", f"expected 'function', got {tool.get('type')!r}")
            tool = tool["function"]
        if not isinstance(tool, Mapping):
            raise _fail(where, f"tools[{i}]", f"expected an object, got {type(tool).__name__}")
        flat = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        flat.setdefault("parameters", {"type": "object", "properties": {}})
        if map_types:
            flat["parameters"] = map_schema_types(flat["parameters"])
        if errors := tool_errors(flat):
            field, message = errors[0].split(": ", 1)
            if not map_types and field.endswith("type") and any(repr(t) in message for t in NONSTANDARD_TYPES):
                message += " (not a JSON Schema type; data.map_schema_types: true maps dict, float, tuple and any)"
            raise _fail(where, f"tools[{i}]" + ("" if field == "$" else f".{field}"), message)
        tools.append(flat)
    return tools


def _call(raw: Any, where: str, field: str) -> tuple[str, dict[str, Any]]:
    """``(tool_call_id, {"name", "arguments"})`` of one OpenAI tool call."""
    if not isinstance(raw, Mapping):
        raise _fail(where, field, f"expected an object, got {type(raw).__name__}")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(where, f"{field}.id", "expected a non-empty string (the tool message names it in tool_call_id)")
    function = raw.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _fail(where, f"{field}.function.name", "expected a function object with a string name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise _fail(where, f"{field}.function.arguments",
                        f"not valid JSON ({err.msg} at column {err.colno})") from err  # fmt: skip
    if not isinstance(arguments, dict):
        raise _fail(where, f"{field}.function.arguments", f"expected a JSON object, got {type(arguments).__name__}")
    return call_id, {"name": function["name"], "arguments": arguments}


def _result(content: str) -> dict[str, Any]:
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return {"content": content}
    return value if isinstance(value, dict) else {"content": content}


def _results_by_id(messages: Sequence[Any], where: str) -> dict[str, tuple[int, dict[str, Any]]]:
    results: dict[str, tuple[int, dict[str, Any]]] = {}
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _fail(where, f"messages[{i}].tool_call_id", "expected the id of the call this result answers")
            if call_id in results:
                raise _fail(where, f"messages[{i}].tool_call_id", f"a second result for call {call_id!r}")
            results[call_id] = (i, _result(_content(message, where, f"messages[{i}].content")))
    return results


def row_to_item(row: Any, where: str, default_id: str, map_types: bool = False) -> dict[str, Any]:
    """One OpenAI-format row as an internal item (module docstring), validated (``map_types``:
    :func:`map_schema_types` on its tools first).

    Raises:
        DatasetError: ``where: field: problem`` for the first bad field.
    """
    if not isinstance(row, Mapping):
        raise _fail(where, "<row>", f"expected a JSON object, got {type(row).__name__}")
    if unknown := sorted(set(row) - _ROW_FIELDS):
        raise _fail(where, unknown[0], f"unknown field (expected some of {sorted(_ROW_FIELDS)})")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail(where, "messages", "expected a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise _fail(where, f"messages[{i}].role", "expected an object with role system/user/assistant/tool")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise _fail(where, "messages", "no user message")
    last_user = users[-1]
    tools = _tools(row, where, map_types)
    results = _results_by_id(messages, where)
    used: set[str] = set()

    def calls_of(i: int) -> list[tuple[str, dict[str, Any]]]:
        calls = _json_field(messages[i].get("tool_calls") or [], where, f"messages[{i}].tool_calls")
        if not isinstance(calls, list):
            raise _fail(where, f"messages[{i}].tool_calls", f"expected a list, got {type(calls).__name__}")
        out = [_call(c, where, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        for j, (call_id, call) in enumerate(out):
            if errors := validate_call(call, tools):
                part = "name" if errors[0].startswith("unknown_tool") else "arguments"
                raise _fail(where, f"messages[{i}].tool_calls[{j}].function.{part}", "; ".join(errors))
            if call_id not in results:
                raise _fail(where, f"messages[{i}].tool_calls[{j}].id", f"no tool message answers call {call_id!r}")
            if call_id in used:
                raise _fail(where, f"messages[{i}].tool_calls[{j}].id", f"call id {call_id!r} is used twice")
            used.add(call_id)
        return out

    instructions = None
    history: list[dict[str, Any]] = []
    for i, message in enumerate(messages[: last_user + 1]):
        role, content = message["role"], _content(message, where, f"messages[{i}].content")
        if role == "system":
            if instructions is not None or i != 0:
                raise _fail(where, f"messages[{i}].role", "one system message, first, is supported")
            instructions = content
        elif role in ("user", "assistant") and not message.get("tool_calls"):
            history.append({"role": role, "content": content})
        elif role == "assistant":
            for j, (call_id, call) in enumerate(calls_of(i)):
                history.append({"role": "assistant", "content": content if j == 0 else "", "tool_calls": [call]})
                history.append({"role": "tool", "content": json.dumps(results[call_id][1], separators=(",", ":"),
                                                                      ensure_ascii=False)})  # fmt: skip
    expected: list[dict[str, Any]] = []
    fixtures: list[dict[str, Any]] = []
    alt_ids: list[str] = []
    groups: list[list[int]] = []
    reference, answer = "", None
    for i in range(last_user + 1, len(messages)):
        message = messages[i]
        if message["role"] == "tool":
            continue  # consumed through its call's id
        if message["role"] != "assistant":
            raise _fail(where, f"messages[{i}].role", f"only assistant and tool turns follow the last user message, "
                                                      f"got {message['role']!r}")  # fmt: skip
        if answer is not None:
            raise _fail(where, f"messages[{i}]", "the assistant answer must be the last turn")
        content = _content(message, where, f"messages[{i}].content")
        if not message.get("tool_calls"):
            answer = content
            continue
        turn_calls = calls_of(i)
        if len(turn_calls) > 1:
            groups.append([len(expected), len(expected) + len(turn_calls)])
        for j, (call_id, call) in enumerate(turn_calls):
            result = results[call_id][1]
            expected.append(call)
            alt_ids.append(call_id)
            fixtures.append({"name": call["name"], "arguments": call["arguments"], "result": result})
            reference += tool_call_text(call, content if j == 0 else "") + tool_result_text(result)
    if answer is None:
        raise _fail(where, "messages", "the conversation must end with an assistant answer (content, no tool_calls)")
    if orphans := sorted(set(results) - used):
        index = results[orphans[0]][0]
        raise _fail(where, f"messages[{index}].tool_call_id", f"no assistant tool call has id {orphans[0]!r}")
    per_call = {}
    for name, shape in (("argument_alternatives", "{tool_call_id: {argument: [values]}}"),
                        ("optional_arguments", "{tool_call_id: [argument names]}")):  # fmt: skip
        per_call[name] = _json_field(row.get(name, {}), where, name)
        if not isinstance(per_call[name], Mapping):
            raise _fail(where, name, f"expected {shape}")
        if unknown_ids := sorted(set(per_call[name]) - set(alt_ids)):
            raise _fail(where, f"{name}.{unknown_ids[0]}", "not the id of an expected call")
    kind = row.get("kind") or ("multi" if len(expected) > 1 else "single" if expected else "no_tool")
    item: dict[str, Any] = {
        "id": str(row.get("id") or default_id),
        "kind": kind,
        "locale": row.get("locale", "en"),
        "messages": [],
        "tool_should_be_used": bool(expected),
        "expected_calls": expected,
        "fixtures": fixtures,
        "integration_fields": list(row.get("integration_fields", [])),
        "pii": list(row.get("pii", [])),
        "reference": reference + answer_text(answer),
        "tools": tools,
    }
    if instructions is not None:
        item["instructions"] = instructions
    if groups:
        item["parallel_calls"] = groups
    if per_call["argument_alternatives"]:
        item["argument_alternatives"] = [dict(per_call["argument_alternatives"].get(i, {})) for i in alt_ids]
    if per_call["optional_arguments"]:
        item["optional_arguments"] = [list(per_call["optional_arguments"].get(i, [])) for i in alt_ids]
    if item["locale"] not in LOCALES:
        raise _fail(where, "locale", f"expected one of {LOCALES}, got {item['locale']!r}")
    item["messages"] = [{"role": "system", "content": item_system_prompt(item)}, *history]
    validate_item(item, where)
    return item


# --------------------------------------------------------------------------------------
# Sources


def jsonl_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(file:line, row)`` of a JSONL file (blank lines skipped); a malformed line gives its
    :class:`DatasetError` in place of the row (:func:`read_items` raises or skips it)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: <file>: not found")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(decode_line(raw, f"{path}:{number}"))
            except DatasetError as err:
                row = err
            except json.JSONDecodeError as err:
                row = DatasetError(f"{path}:{number}: <json>: malformed JSON ({err.msg} at column {err.colno})")
            yield f"{path}:{number}", row


def hf_rows(path: str | Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """``(file:row, row)`` of a local json/jsonl/parquet file through Hugging Face ``datasets``
    (``load_dataset``; nothing is downloaded). Row numbers count from 1, like lines.

    Arrow gives every row the union of all rows' keys: a key another row has but this one lacks
    comes back as ``None``; those ``None`` values are dropped (store ``tools`` and ``arguments`` as
    JSON strings to keep them exactly as written).
    """
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise DatasetError(f"{path}: <file>: the 'datasets' package is needed for data.format 'hf' "
                           "(pip install 'distillgates[data]')") from err  # fmt: skip
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: <file>: not found")
    builder = "parquet" if path.suffix == ".parquet" else "json"
    if builder == "json":  # datasets' own error names neither the line nor the byte
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                decode_line(raw, f"{path}:{number}")
    dataset = load_dataset(builder, data_files={split: str(path)}, split=split)
    for number, row in enumerate(dataset, start=1):
        yield f"{path}:{number}", _drop_none(row)


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def read_items(
    path: str | Path, fmt: str = "jsonl", map_types: bool = False, skipped: list[dict[str, str]] | None = None
) -> list[dict[str, Any]]:
    """Items of an OpenAI-format file (``fmt``: ``jsonl`` or ``hf``); ids must be unique.

    Args:
        map_types: map the :data:`NONSTANDARD_TYPES` of the rows' tool schemas (``data.map_schema_types``).
        skipped: given, a bad row (malformed line, a field :func:`row_to_item` rejects, a repeated id) is
            left out and appended as ``{"where": "file:line", "reason": "field: problem"}`` instead of raising
            (``data.invalid_rows: skip``).

    Raises:
        DatasetError: naming the file, line and field of the first bad row (``skipped`` not given), or
            ``<file>`` when no row is left.
    """
    rows = jsonl_rows(path) if fmt == "jsonl" else hf_rows(path)
    stem = Path(path).stem
    items: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, row in rows:
        number = where.rsplit(":", 1)[1]
        try:
            if isinstance(row, DatasetError):
                raise row
            item = row_to_item(row, where, f"{stem}-{int(number):06d}", map_types)
            if item["id"] in seen:
                raise _fail(where, "id", f"duplicate id {item['id']!r} (first at {seen[item['id']]})")
        except DatasetError as err:
            if skipped is None:
                raise
            skipped.append({"where": where, "reason": str(err).removeprefix(f"{where}: ")})
            continue
        seen[item["id"]] = where
        items.append(item)
    if not items:
        raise DatasetError(f"{path}: <file>: no rows" + (f" left ({len(skipped)} skipped)" if skipped else ""))
    return items


def split_items(
    items: Sequence[dict[str, Any]], eval_fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, eval)``: a seeded shuffle, ``eval_fraction`` of the items (at least one) held out."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(items) * eval_fraction))
    if n_eval >= len(items):
        raise DatasetError(f"eval_fraction {eval_fraction} leaves no training items out of {len(items)}")
    held = set(order[:n_eval])
    return [it for i, it in enumerate(items) if i not in held], [it for i, it in enumerate(items) if i in held]
