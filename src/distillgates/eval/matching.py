"""What counts as the same value and the same call: normalization and BFCL-style argument matching.

Shared by the tool broker (fixture lookup), the training losses (is a call covered) and the
scorer (argument match, grounded spans). Kept apart from the scorer's metrics so that a change to
how quality is *reported* never re-runs what *uses* these rules (the KD set, training).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jsonschema import Draft202012Validator

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
    """Lax numeric equality: 1% relative tolerance, or ``a`` is ``b`` rounded to an integer."""
    return math.isclose(a, b, rel_tol=0.01, abs_tol=1e-9) or (a == round(a) and a == round(b))


def normalize_text(text: str) -> str:
    """Case-fold, drop punctuation, collapse whitespace."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.casefold())).strip()


def normalize_value(value: Any, locale: str = "en") -> Any:
    """Lax canonical form of an argument value (numbers as float, strings normalized, recursive)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        number = parse_number(value, locale)
        return number if number is not None else normalize_text(value)
    if isinstance(value, Mapping):
        return {str(k): normalize_value(v, locale) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [normalize_value(v, locale) for v in value]
    return value


def values_equal_lax(a: Any, b: Any, locale: str = "en") -> bool:
    na, nb = normalize_value(a, locale), normalize_value(b, locale)
    if isinstance(na, float) and isinstance(nb, float):
        return numbers_close(na, nb)
    return na == nb


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


def value_matches(value: Any, want: Any, lax: bool, locale: str = "en", alternatives: Sequence[Any] = ()) -> bool:
    """``value`` equals the expected value or one of its BFCL-style acceptable ``alternatives``
    (strict: exact; lax: :func:`values_equal_lax`)."""
    for candidate in (want, *alternatives):
        if values_equal_lax(value, candidate, locale) if lax else value == candidate:
            return True
    return False


def match_call(
    predicted: Mapping[str, Any] | None,
    expected: Mapping[str, Any],
    lax: bool,
    locale: str = "en",
    tools: Sequence[Mapping[str, Any]] | None = None,
    alternatives: Mapping[str, Sequence[Any]] | None = None,
) -> str | None:
    """``None`` when ``predicted`` matches ``expected``; otherwise the failure reason.

    Args:
        tools: the item's tools (:func:`~distillgates.data.tools.item_tools`); ``None``: the toy registry.
        alternatives: ``{argument: [acceptable values]}`` besides the expected value (BFCL's
            possible answers): a free-text query may be phrased several ways.
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
        if name in args:
            continue
        if name in required:
            return "missing_required"
        if properties.get(name, {}).get("default", absent) != want[name]:
            return "value_error"  # an optional expected argument left out is fine only at its default
    for name, value in args.items():
        if name not in properties:
            return "unexpected_param"
        if name not in want and value != properties[name].get("default", absent):
            return "unexpected_param"
        if not _type_ok(value, properties[name]):
            return "type_error"
    for name, value in args.items():
        if name in want and not value_matches(value, want[name], lax, locale, alternatives.get(name, ())):
            return "value_error"
    return None


# --------------------------------------------------------------------------------------
# Spans and integration
