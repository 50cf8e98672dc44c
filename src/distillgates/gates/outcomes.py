"""The outcome of every collected gate test, for the gate reports.

A :class:`~distillgates.gates.core.GateRecord` exists only when a gate helper is called: a crash, a
fixture error or a skip leaves none. The plugin reports every phase of every gate test here, so the
reports list each test with its real outcome and a session with any fail or error never reads as a pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

# pass | blessed (a --bless session stored its figures) | fail (a gate's criterion) | error (a crash or a fixture
# error) | not measured (skipped, with the reason) | underpowered (a drift gate that could not have failed) |
# inconclusive | stopped | deselected (collected, not selected)
OUTCOMES = ("pass", "blessed", "fail", "error", "not measured", "underpowered", "inconclusive", "stopped",
            "deselected")
NOT_RUN = "not run: the session ended before this test (-x, --maxfail or an interrupt)"


@dataclass
class TestOutcome:
    """One collected gate test as the reports show it."""

    __test__ = False  # not a pytest test class

    nodeid: str
    group: str
    outcome: str = "stopped"
    reason: str = NOT_RUN
    failed: bool = False  # pytest counted it failed (a fail, an error, an inconclusive speed gate under CI)

    @property
    def name(self) -> str:
        """The test's name: its node id after the file."""
        return self.nodeid.split("::", 1)[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TestLog:
    """Every collected gate test and its outcome, built from pytest's phase reports."""

    __test__ = False

    def __init__(self) -> None:
        self.tests: dict[str, TestOutcome] = {}

    def collected(self, nodeid: str, group: str) -> None:
        self.tests.setdefault(nodeid, TestOutcome(nodeid, group))

    def deselected(self, nodeid: str, group: str, reason: str) -> None:
        self.tests[nodeid] = TestOutcome(nodeid, group, "deselected", reason)

    def phase(self, nodeid: str, when: str, outcome: str, message: str, *, assertion: bool = False,
              special: str | None = None) -> None:
        """One phase report (``when``: setup, call, teardown; ``outcome``: passed, failed, skipped).

        ``message``: the exception line (failed) or the skip reason; ``assertion``: the call failed on an
        assertion (a gate's criterion, ``pytest.fail``) rather than crashing; ``special``: how a gate that decided
        nothing ended (``inconclusive``, ``stopped``, ``not measured``, ``underpowered``).
        """
        test = self.tests.get(nodeid)
        if test is None:
            return  # not a gate test
        if outcome == "passed":
            if when == "call":
                test.outcome, test.reason = "pass", ""
        elif outcome == "skipped":
            test.outcome, test.reason = special or "not measured", message
        elif not (when == "teardown" and test.failed):  # a teardown error after a failure adds nothing
            test.failed = True
            test.outcome = special or ("fail" if when == "call" and assertion else "error")
            test.reason = message

    def finish(self, blessed: set[str]) -> list[TestOutcome]:
        """The tests in collection order; a passed test whose gate blessed a figure reads ``blessed``."""
        for test in self.tests.values():
            if test.outcome == "pass" and test.nodeid in blessed:
                test.outcome = "blessed"
        return list(self.tests.values())


def summarize_tests(tests: list[TestOutcome]) -> dict[str, int]:
    counts = Counter(t.outcome for t in tests)
    return {outcome: counts[outcome] for outcome in OUTCOMES if counts[outcome]}


def session_result(tests: list[TestOutcome], exit_status: int) -> tuple[str, str]:
    """(``pass`` or ``fail``, why): a session with any failed test, or that pytest failed, never reads as a pass."""
    failed = [t for t in tests if t.failed]
    if failed:
        return "fail", f"{len(failed)} gate test(s) failed or errored"
    if exit_status not in (0, 5):  # 5: no tests collected
        return "fail", f"pytest exit status {exit_status} (a collection error, a non-gate test failed or an interrupt)"
    if not tests:
        return "pass", "no gate test collected"
    return "pass", "no fail, no error"
