"""What counts as the same value and the same call: normalization and BFCL-style argument matching.

Shared by the tool broker (fixture lookup), the training losses (is a call covered) and the
scorer (argument match, grounded spans). Kept apart from the scorer's metrics so that a change to
how quality is *reported* never re-runs what *uses* these rules (the KD set, training).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from jsonschema import Draft202012Validator
from scipy.optimize import linear_sum_assignment

from distillgates.data.tools import tools_by_name

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?![\w])")
_PUNCT = re.compile(r"[^\w\s]")
_SPACE = re.compile(r"\s+")


# --------------------------------------------------------------------------------------
# Normalization


def parse_number(text: str, locale: str = "en") -> float | None:
    """A number from its surface text, or ``None``. Handles "1,234.5", "1.234,5" and "21,5" (de)."""
    text = text.strip().lstrip("+")
    if not text or not re.fullmatch(r"-?\d+(?:[.,]\d+)*", text):
        return None
    if "," in text and "." in text:
        decimal = "," if text.rfind(",") > text.rfind(".") else "."
    elif "," in text:
        groups = text.split(",")
        thousands = len(groups) > 2 or (locale != "de" and len(groups[-1]) == 3)
        decimal = "." if thousands else ","
    elif "." in text:
        groups = text.split(".")
        decimal = "," if locale == "de" and (len(groups) > 2 or len(groups[-1]) == 3) else "."
    else:
        decimal = "."
    number = text.replace("," if decimal == "." else ".", "")
    if number.count(decimal) > 1:  # "0.07.4": number-like model output that is no number
        return None
    return float(number.replace(decimal, "."))


def numbers_close(a: float, b: float) -> bool:
    """1% relative tolerance, symmetric, with no absolute tolerance (``1e-9`` is not ``2e-9``)."""
    return math.isclose(a, b, rel_tol=0.01)


def normalize_text(text: str) -> str:
    """Case-fold, drop punctuation, collapse whitespace."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.casefold())).strip()


def normalize_value(value: Any) -> Any:
    """Canonical form of an argument value, the same for both sides of any comparison: numbers as float,
    strings (digit strings too) as :func:`normalize_text`, recursively."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, Mapping):
        return {str(k): normalize_value(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [normalize_value(v) for v in value]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _types(schema: Mapping[str, Any] | None) -> list[Any]:
    kind = (schema or {}).get("type")
    return kind if isinstance(kind, list) else [kind]


def values_equal_strict(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (``21 == 21.0``), booleans only equal booleans, containers recursively."""
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal_strict(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equal_strict(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and bool(a == b)


def values_equal_lax(a: Any, b: Any, schema: Mapping[str, Any] | None = None) -> bool:
    """Lax equality (docs/metrics.md "Argument match"), symmetric in ``a`` and ``b``.

    Strings: equal after :func:`normalize_text` (never read as numbers: a digit string is an
    identifier). Numbers: equal, or both non-integer under a schema type that is not ``integer``
    and :func:`numbers_close`. Booleans and null: identical. Containers: recursively, keys and lengths exact.
    """
    if _is_number(a) and _is_number(b):
        if a == b:
            return True
        integral = "integer" in _types(schema) or float(a).is_integer() or float(b).is_integer()
        return not integral and numbers_close(float(a), float(b))
    if isinstance(a, str) and isinstance(b, str):
        na, nb = normalize_text(a), normalize_text(b)
        return na == nb and (bool(na) or a == b)  # punctuation-only strings compare as written
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        properties = (schema or {}).get("properties") or {}
        return a.keys() == b.keys() and all(values_equal_lax(a[k], b[k], properties.get(k)) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        items = (schema or {}).get("items")
        items = items if isinstance(items, Mapping) else None
        return len(a) == len(b) and all(values_equal_lax(x, y, items) for x, y in zip(a, b))
    return values_equal_strict(a, b)


def value_text(value: Any) -> str:
    """Canonical text of a leaf value: JSON text for numbers (21, 21.5), the string itself otherwise."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def leaves(obj: Any) -> Iterable[Any]:
    """Scalar leaves of a JSON value."""
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from leaves(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from leaves(value)
    elif obj is not None and not isinstance(obj, bool):
        yield obj


# --------------------------------------------------------------------------------------
# Argument match (BFCL-style)


def _type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    """JSON Schema type check (the validator's own type checker: 5.0 is an integer, True is not)."""
    expected = schema.get("type")
    if expected is None:
        return True
    types = expected if isinstance(expected, list) else [expected]
    return any(Draft202012Validator.TYPE_CHECKER.is_type(value, t) for t in types)


def value_matches(value: Any, candidates: Sequence[Any], lax: bool, schema: Mapping[str, Any] | None = None) -> bool:
    """``value`` equals one of ``candidates`` (the expected value and its acceptable alternatives):
    strict: :func:`values_equal_strict`; lax: :func:`values_equal_lax` under the parameter's ``schema``."""
    if lax:
        return any(values_equal_lax(value, candidate, schema) for candidate in candidates)
    return any(values_equal_strict(value, candidate) for candidate in candidates)


def call_leniency(item: Mapping[str, Any]) -> tuple[list[Mapping[str, Sequence[Any]]], list[set[str]]]:
    """Per expected call of ``item``: its ``argument_alternatives`` and its ``optional_arguments`` (as sets), empty
    where the item gives none: the ``alternatives`` and ``optional`` of :func:`match_call`."""
    expected = item.get("expected_calls") or []
    alternatives = list(item.get("argument_alternatives") or [{} for _ in expected])
    return alternatives, [set(names) for names in item.get("optional_arguments") or [[] for _ in expected]]


def match_call(
    predicted: Mapping[str, Any] | None,
    expected: Mapping[str, Any],
    lax: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    alternatives: Mapping[str, Sequence[Any]] | None = None,
    optional: Collection[str] = (),
) -> str | None:
    """``None`` when ``predicted`` matches ``expected``; otherwise the failure reason (docs/metrics.md).

    Args:
        tools: the item's tools (:func:`~distillgates.data.tools.item_tools`); ``None``: the toy registry.
        alternatives: ``{argument: [acceptable values]}`` besides the expected value (BFCL's
            possible answers): a free-text query may be phrased several ways.
        optional: arguments that may be given or left out whatever the expected call does; given, an
            argument the expected call lacks must match one of its ``alternatives`` (any value when it has none).
    """
    if predicted is None:
        return "invalid_json"
    if predicted.get("name") != expected["name"]:
        return "wrong_func_name"
    tool = tools_by_name(tools).get(str(expected["name"]))
    if tool is None:
        return "unknown_tool"
    params = tool.get("parameters") or {}
    properties, required = params.get("properties", {}), set(params.get("required", []))
    args, want = predicted.get("arguments") or {}, expected["arguments"]
    alternatives = alternatives or {}
    if not isinstance(args, Mapping):
        return "type_error"
    absent = object()
    for name in sorted(required | set(want)):
        if name in args or (name in optional and name not in required):
            continue
        if name in required:
            return "missing_required"
        if properties.get(name, {}).get("default", absent) != want[name]:
            return "value_error"  # an optional expected argument left out is fine only at its default
    for name, value in args.items():
        if name not in properties:
            return "unexpected_param"
        if name not in want and name not in optional and value != properties[name].get("default", absent):
            return "unexpected_param"
        if not _type_ok(value, properties[name]):
            return "type_error"
    for name, value in args.items():
        if name in want:
            candidates = [want[name], *alternatives.get(name, ())]
        elif name in optional and alternatives.get(name):
            candidates = list(alternatives[name])
        else:
            continue  # at its schema default, or an optional argument without listed values
        if not value_matches(value, candidates, lax, properties[name]):
            return "value_error"
    return None


def pair_parallel_calls(
    emitted: Sequence[Any],
    expected: Sequence[Mapping[str, Any]],
    groups: Sequence[Sequence[int]],
    lax: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    alternatives: Sequence[Mapping[str, Sequence[Any]]] = (),
    optional: Sequence[Collection[str]] = (),
) -> list[Any]:
    """The emitted calls with each parallel group (``[first, end)`` of the expected calls, from one assistant
    message with several calls; BFCL's parallel category) reordered to the optimal assignment in this mode:
    most calls matching (:func:`match_call` with ``lax``), then most right names, then fewest moved
    (``scipy.optimize.linear_sum_assignment``; any group size). A group the emitted calls do not reach keeps
    the emitted order. The position of the k-th expected call holds the emitted call paired with it."""
    out = list(emitted)
    for first, end in groups:
        if end > len(out):
            continue
        n = end - first
        weight = n + 1  # a match outweighs every name, a name every move
        cost = np.zeros((n, n))
        for i, call in enumerate(emitted[first:end]):
            for k in range(n):
                j = first + k
                alts = alternatives[j] if j < len(alternatives) else {}
                opt = optional[j] if j < len(optional) else ()
                unmatched = match_call(call, expected[j], lax, tools, alts, opt) is not None
                unnamed = not (isinstance(call, Mapping) and call.get("name") == expected[j]["name"])
                cost[i, k] = weight * weight * unmatched + weight * unnamed + (i != k)
        rows, cols = linear_sum_assignment(cost)
        for i, k in zip(rows, cols):
            out[first + int(k)] = emitted[first + int(i)]
    return out


# --------------------------------------------------------------------------------------
# Spans and integration
