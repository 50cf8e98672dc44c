"""Tool broker: deterministic replay of tool results from the dataset's fixtures.

Evaluation never runs a real tool: every call is answered from the fixture table, keyed by tool
name and *normalized* arguments (case, whitespace, punctuation, numbers as floats rounded to 6
significant digits), so ``{"city": " paris "}`` and ``{"city": "Paris"}`` hit the same fixture
and ``21`` equals ``21.0``. A miss returns an error result to the model (the conversation
goes on, the model may recover) and is counted for the fixture hit-rate; it never raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distillgates.eval.matching import normalize_value


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def fixture_key(name: Any, arguments: Any) -> str:
    """Canonical key of a call: tool name + normalized arguments (sorted-key JSON)."""
    normalized = _round(normalize_value(arguments)) if isinstance(arguments, Mapping) else repr(arguments)
    return json.dumps([str(name), normalized], sort_keys=True, ensure_ascii=False)


@dataclass
class BrokerStats:
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return None if total == 0 else self.hits / total


class ToolBroker:
    """Replays fixture results for tool calls.

    Args:
        fixtures: ``{"name", "arguments", "result"}`` records (from one item or a whole set).
            Two fixtures with the same key but different results are a data error.
    """

    def __init__(self, fixtures: Iterable[Mapping[str, Any]]) -> None:
        self.table: dict[str, dict[str, Any]] = {}
        for fixture in fixtures:
            key = fixture_key(fixture["name"], fixture["arguments"])
            if key in self.table and self.table[key] != fixture["result"]:
                raise ValueError(f"conflicting fixtures for {key}: {self.table[key]} vs {fixture['result']}")
            self.table[key] = dict(fixture["result"])
        self.stats = BrokerStats()

    @classmethod
    def for_item(cls, item: Mapping[str, Any]) -> ToolBroker:
        return cls(item.get("fixtures", []))

    def call(self, name: Any, arguments: Any) -> tuple[dict[str, Any], bool]:
        """``(result, hit)``: the fixture result, or an error result for the model on a miss."""
        result = self.table.get(fixture_key(name, arguments))
        if result is None:
            self.stats.misses += 1
            return {"error": f"no result for tool {name!r} with these arguments"}, False
        self.stats.hits += 1
        return dict(result), True
