"""Tool broker: deterministic replay of tool results from the dataset's fixtures.

Evaluation never runs a real tool: every call is answered from the fixture table, keyed by tool
name and *normalized* arguments (case, whitespace, punctuation, numbers as floats rounded to 6
significant digits), so ``{"city": " paris "}`` and ``{"city": "Paris"}`` hit the same fixture
and ``21`` equals ``21.0``. An item's ``argument_alternatives`` (BFCL-style acceptable values of an
expected call's arguments) are keys of that call's fixture too, so a search query phrased another
acceptable way gets the same result; so are its ``optional_arguments`` given or left out.

A call without a fixture is answered by the :class:`FixturePolicy`, never silently: ``error`` (the
default) gives the model an error result (the conversation goes on, the model may recover) and
counts a miss against the fixture hit-rate; ``mock`` gives it the configured mock result, counts a
miss too and marks the call ``mocked`` (the scorer reports ``mocked_calls`` apart). It never raises.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


MISSING_FIXTURE_POLICIES = ("error", "mock")


@dataclass(frozen=True)
class FixturePolicy:
    """How the broker answers a call that no fixture covers (``eval.missing_fixture``)."""

    missing: str = "error"  # "error": an error result; "mock": mock_result. Either way a counted miss
    mock_result: dict[str, Any] = field(default_factory=lambda: {"status": "ok"})

    def __post_init__(self) -> None:
        if self.missing not in MISSING_FIXTURE_POLICIES:
            raise ValueError(f"missing_fixture must be one of {MISSING_FIXTURE_POLICIES}, got {self.missing!r}")


class BrokerAnswer(NamedTuple):
    result: dict[str, Any]
    hit: bool  # answered from a fixture
    mocked: bool = False  # no fixture: the policy's mock result


@dataclass
class BrokerStats:
    hits: int = 0
    misses: int = 0
    mocked: int = 0  # misses answered with the mock result

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return None if total == 0 else self.hits / total


class ToolBroker:
    """Replays fixture results for tool calls.

    Args:
        fixtures: ``{"name", "arguments", "result"}`` records (from one item or a whole set).
            Two fixtures with the same key but different results are a data error.
        policy: the answer to a call without a fixture (default: an error result).
        aliases: ``(name, arguments)`` keys that answer like a fixture's own (:meth:`for_item`).
    """

    def __init__(
        self,
        fixtures: Iterable[Mapping[str, Any]],
        policy: FixturePolicy | None = None,
        aliases: Iterable[tuple[str, Mapping[str, Any], Mapping[str, Any]]] = (),
    ) -> None:
        self.table: dict[str, dict[str, Any]] = {}
        self.policy = policy or FixturePolicy()
        for fixture in fixtures:
            self._add(fixture["name"], fixture["arguments"], fixture["result"])
        for name, arguments, result in aliases:
            self._add(name, arguments, result)
        self.stats = BrokerStats()

    def _add(self, name: Any, arguments: Any, result: Mapping[str, Any]) -> None:
        key = fixture_key(name, arguments)
        if key in self.table and self.table[key] != result:
            raise ValueError(f"conflicting fixtures for {key}: {self.table[key]} vs {result}")
        self.table[key] = dict(result)

    @classmethod
    def for_item(cls, item: Mapping[str, Any], policy: FixturePolicy | None = None) -> ToolBroker:
        """The item's fixtures, plus each expected call's acceptable argument variants as keys of its fixture
        (its ``argument_alternatives``, and its ``optional_arguments`` given or left out)."""
        fixtures = list(item.get("fixtures", []))
        expected = item.get("expected_calls", [])
        aliases = []
        all_alternatives = item.get("argument_alternatives") or [{} for _ in expected]
        all_optional = item.get("optional_arguments") or [[] for _ in expected]
        for call, alternatives, optional in zip(expected, all_alternatives, all_optional):
            key = fixture_key(call["name"], call["arguments"])
            result = next((f["result"] for f in fixtures if fixture_key(f["name"], f["arguments"]) == key), None)
            if result is None or not (alternatives or optional):
                continue
            names = sorted(set(alternatives) | set(optional))
            choices = ([call["arguments"].get(n), *alternatives.get(n, ()), *([None] if n in optional else [])]
                       for n in names)  # fmt: skip
            for values in itertools.product(*choices):
                arguments = {**call["arguments"], **dict(zip(names, values))}
                aliases.append((call["name"], {k: v for k, v in arguments.items() if v is not None}, result))
        return cls(fixtures, policy, aliases)

    def call(self, name: Any, arguments: Any) -> BrokerAnswer:
        """The fixture result (a hit), or the policy's answer on a miss."""
        result = self.table.get(fixture_key(name, arguments))
        if result is not None:
            self.stats.hits += 1
            return BrokerAnswer(dict(result), True)
        self.stats.misses += 1
        if self.policy.missing == "mock":
            self.stats.mocked += 1
            return BrokerAnswer(dict(self.policy.mock_result), False, True)
        return BrokerAnswer({"error": f"no result for tool {name!r} with these arguments"}, False)
