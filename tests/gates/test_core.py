"""Gate helper: verdicts, records, failure messages, blessing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from distillgates.eval.fingerprints import FINGERPRINT_KEYS
from distillgates.gates import (
    BaselineStore,
    Gate,
    GateContext,
    GateFailure,
    GateInconclusive,
    GateStopped,
    SpeedSettings,
)
from distillgates.gates.references import StaleReference
from distillgates.gates.speed_ab import SpeedRounds

RUN = {key: f"{key}-1" for key in FINGERPRINT_KEYS}  # the gated run's report fingerprints
INF = float("inf")


def make_gate(tmp_path, bless: bool = False, **context) -> tuple[Gate, list]:
    recorded: list = []
    context.setdefault("run_fingerprints", RUN)
    ctx = GateContext(store=BaselineStore(tmp_path, "p"), bless=bless, **context)
    return Gate(ctx, "gates/test_x.py::test_y", "quality", lambda k, v: recorded.append((k, v))), recorded


def test_at_least_pass_records_properties(tmp_path):
    gate, recorded = make_gate(tmp_path)
    rec = gate.at_least("f1", 0.95, 0.9)
    assert rec.verdict == "pass"
    for pair in (("f1.measured", 0.95), ("f1.threshold", 0.9), ("f1.verdict", "pass")):
        assert pair in recorded


@pytest.mark.parametrize("value", [0.5, float("nan"), None, INF, -INF])
def test_at_least_failure_message_has_the_numbers(tmp_path, value):
    gate, _ = make_gate(tmp_path)
    with pytest.raises(GateFailure, match=r"quality/f1 FAILED: measured .* >= threshold 0.9"):
        gate.at_least("f1", value, 0.9)
    assert gate.context.records[-1].verdict == "fail"


@pytest.mark.parametrize("value", [float("nan"), INF, -INF, None])
def test_at_most_fails_a_value_that_is_not_a_finite_number(tmp_path, value):
    gate, _ = make_gate(tmp_path)
    with pytest.raises(GateFailure, match=r"quality/ttfa FAILED: measured .* <= threshold 25"):
        gate.at_most("ttfa", value, 25.0)


@pytest.mark.parametrize("threshold", [float("nan"), INF, -INF])
def test_a_threshold_that_is_not_finite_bounds_nothing(tmp_path, threshold):
    gate, _ = make_gate(tmp_path)
    with pytest.raises(GateFailure):
        gate.at_least("f1", 0.95, threshold)
    with pytest.raises(GateFailure):
        gate.at_most("ttfa", 10.0, threshold)


def test_at_most_and_equals(tmp_path):
    gate, _ = make_gate(tmp_path)
    gate.at_most("controls", 0, 0)
    gate.equals("ok", True, True)
    with pytest.raises(GateFailure):
        gate.at_most("controls", 1, 0)
    with pytest.raises(GateFailure, match="ok"):
        gate.equals("ok", False, True)


def test_no_regression_bless_then_compare(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True)
    assert gate.no_regression("f1", 0.9, tolerance=0.01).verdict == "blessed"
    gate.context.store.commit()
    gate, _ = make_gate(tmp_path)
    assert gate.no_regression("f1", 0.895, tolerance=0.01).verdict == "pass"
    with pytest.raises(GateFailure, match=r"blessed 0\.9: change -0\.02"):
        gate.no_regression("f1", 0.88, tolerance=0.01)


@pytest.mark.parametrize("value", [float("nan"), INF, -INF, None])
def test_no_regression_fails_a_value_that_is_not_a_finite_number(tmp_path, value):
    gate, _ = make_gate(tmp_path, bless=True)
    gate.no_regression("f1", 0.9, tolerance=0.01)
    gate.context.store.commit()
    gate, _ = make_gate(tmp_path)
    with pytest.raises(GateFailure, match="both must be finite numbers"):
        gate.no_regression("f1", value, tolerance=0.01)


@pytest.mark.parametrize("value", [float("nan"), INF, -INF, None])
def test_bless_refuses_a_value_that_is_not_a_finite_number(tmp_path, value):
    gate, _ = make_gate(tmp_path, bless=True)
    with pytest.raises(GateFailure, match=rf"refusing to bless: quality/f1: f1 = {value!r} is not a finite number"):
        gate.no_regression("f1", value, tolerance=0.01)
    assert gate.context.store.staged == {}


def test_bless_refuses_speed_samples_that_are_not_finite(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True)
    with pytest.raises(GateFailure, match=r"refusing to bless: quality/ttft: ttft has non-finite samples \[inf, inf\]"):
        speed_gate(gate, SpeedRounds(processes([1.0] * 7 + [INF]), samples=8, workers=2, looks=1))  # one inf each
    assert gate.context.store.staged == {}


def test_bless_records_the_run_fingerprints_and_refuses_without_them(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True)
    gate.no_regression("f1", 0.9, tolerance=0.01)
    gate.context.store.commit()
    assert gate.context.store.load("quality", "f1", hardware_dependent=False, run_fingerprints=RUN).fingerprints == RUN
    gate, _ = make_gate(tmp_path, bless=True, run_fingerprints={**RUN, "dataset_sha256": None})
    with pytest.raises(GateFailure, match=r"refusing to bless: quality/f1: .*null or missing fingerprint.*dataset_"):
        gate.no_regression("f1", 0.9, tolerance=0.01)


def test_missing_baseline_fails_with_command(tmp_path):
    gate, _ = make_gate(tmp_path, bless_command=lambda nodeid: f"pytest '{nodeid}' --bless")
    with pytest.raises(GateFailure, match=r"bless it with: pytest 'gates/test_x.py::test_y' --bless"):
        gate.no_regression("f1", 0.9, tolerance=0.01)


def test_hardware_mismatch_refuses_hardware_dependent_baselines(tmp_path):
    gate, _ = make_gate(tmp_path, hardware_mismatch="detected X, selected Y")
    with pytest.raises(GateFailure, match="detected X, selected Y"):
        gate.no_regression("share", 0.9, tolerance=0.1, hardware_dependent=True)


class Steady:
    """A synthetic worker process: TTFT samples cycling through ``values`` times ``factor`` (TPS the inverse)."""

    def __init__(self, values: list[float], factor: float = 1.0, log: list[str] | None = None, name: str = "") -> None:
        self.values, self.factor, self.calls, self.log, self.name = values, factor, 0, log, name
        self.closed = False

    def measure(self, n: int) -> dict[str, list[float]]:
        assert not self.closed
        if self.log is not None:
            self.log.append(self.name)
        ttft = [self.factor * self.values[(self.calls + i) % len(self.values)] for i in range(n)]
        self.calls += n
        return {"ttft_ms": ttft, "tps": [1000.0 / t for t in ttft]}

    def close(self) -> None:
        self.closed = True


def processes(values: list[float], factors: list[float] = [1.0]) -> Any:  # noqa: B006 (read only)
    """A factory of synthetic worker processes, the i-th with ``factors[i % len(factors)]`` (its lasting offset)."""
    started: list[Steady] = []

    def start() -> Steady:
        started.append(Steady(values, factors[len(started) % len(factors)]))
        return started[-1]

    start.started = started  # type: ignore[attr-defined]
    return start


STEADY = [10.0, 10.1, 9.9, 10.2, 9.8, 10.0, 10.1, 9.9, 10.05, 9.95]
RECORD = {"code": {"commit": "c" * 40}, "artifacts": {"model": {"sha256": "m" * 64}}}


def speed_gate(gate: Gate, rounds: SpeedRounds) -> Any:
    return gate.speed_no_regression("ttft", rounds, "ttft_ms", threshold=0.05, higher_is_better=False,
                                    definition="d", quantile=0.5, alpha=0.05, n_gates=1)


def test_speed_gate_blesses_the_reference_and_compares_interleaved(tmp_path):
    settings = SpeedSettings(samples=16, workers=3, max_extra_rounds=1)
    gate, _ = make_gate(tmp_path, bless=True, speed=settings)
    speed_gate(gate, SpeedRounds(processes(STEADY), samples=16, workers=3, looks=2, record=lambda: RECORD))
    gate.context.store.commit()
    entry = gate.context.store.load("quality", "ttft", hardware_dependent=True, run_fingerprints=RUN)
    assert entry.provenance["speed_reference"] == RECORD
    assert [len(group) for group in entry.samples] == [16] * 6  # per worker process, every look's round

    gate, _ = make_gate(tmp_path, speed=settings)
    started = []

    def reference(record, rebless):
        started.append(record)
        return processes(STEADY)

    same = SpeedRounds(processes(STEADY), samples=16, workers=3, looks=2, reference=reference)
    assert speed_gate(gate, same).verdict == "pass" and started == [RECORD]
    with pytest.raises(GateFailure, match="significant regression"):
        speed_gate(gate, SpeedRounds(processes(STEADY, [1.3]), samples=16, workers=3, looks=2, reference=reference))
    # candidate processes alternately 10% faster and 50% slower: +16% overall, too spread to be significant
    with pytest.raises(GateInconclusive, match=r"INCONCLUSIVE.*look 2 of at most 2"):
        speed_gate(gate, SpeedRounds(processes(STEADY, [0.9, 1.5]), samples=16, workers=2, looks=2,
                                     reference=reference))


def test_a_failed_speed_gate_stops_the_measurement_and_undecided_gates_are_not_passed(tmp_path):
    def session(fail_first: bool) -> tuple[SpeedRounds, Gate]:
        settings = SpeedSettings(samples=16, workers=3, max_extra_rounds=2)
        gate, _ = make_gate(tmp_path, bless=True, speed=settings)
        speed_gate(gate, SpeedRounds(processes(STEADY), samples=16, workers=3, looks=3, record=lambda: RECORD))
        gate.context.store.commit()
        gate, _ = make_gate(tmp_path, speed=settings)
        rounds = SpeedRounds(processes(STEADY, [1.25, 1.35]), samples=16, workers=3, looks=3,
                             reference=lambda record, rebless: processes(STEADY))
        if fail_first:
            with pytest.raises(GateFailure, match="significant regression"):
                speed_gate(gate, rounds)
        return rounds, gate

    def strict(gate: Gate, rounds: SpeedRounds) -> Any:  # alpha split 10^4 ways: one round is not enough
        return gate.speed_no_regression("ttft", rounds, "ttft_ms", threshold=0.05, higher_is_better=False,
                                        definition="d", quantile=0.5, alpha=0.05, n_gates=10**4)

    rounds, gate = session(fail_first=False)
    with pytest.raises(GateFailure, match=r"look [23] of at most 3"):  # alone it needs another look
        strict(gate, rounds)
    assert rounds.rounds > 1
    rounds, gate = session(fail_first=True)
    with pytest.raises(GateStopped, match=r"NOT DECIDED: ab mode: the session stopped measuring after round 1: "
                                          r"quality/ttft failed.*look 1 of at most 3.*run it alone"):
        strict(gate, rounds)
    assert rounds.rounds == 1 and gate.context.records[-1].verdict == "stopped"


def test_speed_gate_without_a_recorded_reference_fails_with_the_rebless_command(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True, speed=SpeedSettings(samples=8, workers=2, max_extra_rounds=0),
                        bless_command=lambda nodeid: "pytest gates/test_speed.py --bless -m speed")
    speed_gate(gate, SpeedRounds(processes(STEADY), samples=8, workers=2, looks=1))  # no record: stored mode
    gate.context.store.commit()
    gate, _ = make_gate(tmp_path, bless_command=lambda nodeid: "pytest gates/test_speed.py --bless -m speed")
    rounds = SpeedRounds(processes(STEADY), samples=8, workers=2, looks=1,
                         reference=lambda record, rebless: processes(STEADY))
    with pytest.raises(GateFailure, match=r"no re-runnable reference.*re-bless: pytest gates/test_speed.py --bless"):
        speed_gate(gate, rounds)
    assert speed_gate(gate, SpeedRounds(processes(STEADY), samples=8, workers=2, looks=1)).verdict == "pass"


def test_stored_mode_refuses_samples_blessed_without_processes(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True, bless_command=lambda nodeid: "pytest --bless")
    speed_gate(gate, SpeedRounds(processes(STEADY), samples=8, workers=2, looks=1))
    gate.context.store.commit()
    (path,) = tmp_path.glob("p/quality.json")
    data = json.loads(path.read_text())
    data["entries"]["ttft"]["samples"] = [10.0] * 16  # flat, as blessed before samples were kept per process
    path.write_text(json.dumps(data))
    gate, _ = make_gate(tmp_path, bless_command=lambda nodeid: "pytest --bless")
    with pytest.raises(GateFailure, match=r"no raw samples per worker process.*re-bless it: pytest --bless"):
        speed_gate(gate, SpeedRounds(processes(STEADY), samples=8, workers=2, looks=1))


def test_speed_rounds_measure_fresh_process_pairs_abba_and_share_rounds_between_gates():
    order: list[str] = []
    made: list[Steady] = []

    def named(name: str) -> Any:
        def start() -> Steady:
            made.append(Steady(STEADY, log=order, name=name))
            return made[-1]
        return start

    rounds = SpeedRounds(named("C"), samples=24, workers=2, looks=3, reference=lambda record, rebless: named("R"))
    rounds.use_reference(RECORD, "rebless")
    reference, candidate = rounds.after(1, "ttft_ms")
    # per pair: a warm-up block each, then blocks of 8 in ABBA BAAB order; two pairs, each fresh processes
    assert "".join(order) == ("RC" + "RCCRCR") * 2
    assert len(made) == 4 and all(p.closed for p in made)
    assert [len(g) for g in reference] == [len(g) for g in candidate] == [24, 24]
    rounds.after(2, "ttft_ms")
    assert len(made) == 8
    assert rounds.after(1, "ttft_ms")[1] == candidate and len(rounds.after(2, "tps")[1]) == 4  # exactly k rounds
    with pytest.raises(StaleReference, match="another reference"):
        rounds.use_reference({**RECORD, "code": {"commit": "d" * 40}}, "rebless")


def test_speed_rounds_close_every_process_when_a_worker_fails():
    made: list[Steady] = []

    class Broken(Steady):
        def measure(self, n: int) -> dict[str, list[float]]:
            raise RuntimeError("worker died")

    def start() -> Steady:
        made.append(Broken(STEADY) if len(made) == 1 else Steady(STEADY))
        return made[-1]

    rounds = SpeedRounds(start, samples=8, workers=3, looks=1)
    with pytest.raises(RuntimeError, match="worker died"):
        rounds.after(1, "ttft_ms")
    assert len(made) == 3 and all(p.closed for p in made)


def test_paired_no_regression_blesses_items_and_compares_item_by_item(tmp_path):
    blessed = {f"i{n}": 1.0 for n in range(30)}
    gate, _ = make_gate(tmp_path, bless=True)
    assert gate.paired_no_regression("f1", blessed, tolerance=0.01, alpha=0.05, definition="d").verdict == "blessed"
    gate.context.store.commit()
    assert gate.context.store.load("quality", "f1", hardware_dependent=False, run_fingerprints=RUN).items == blessed
    gate, _ = make_gate(tmp_path)
    assert gate.paired_no_regression("f1", {**blessed, "i0": 0.0}, tolerance=0.01, alpha=0.05,
                                     definition="d").verdict == "pass"
    with pytest.raises(GateFailure, match=r"n=30 items \(10 changed\), mean change -0\.3333.*p="):
        gate.paired_no_regression("f1", {k: 0.0 if int(k[1:]) < 10 else 1.0 for k in blessed}, tolerance=0.01,
                                  alpha=0.05, definition="d")
    with pytest.raises(GateFailure, match=r"1 blessed items not in the run \['i0'\]"):
        gate.paired_no_regression("f1", {k: v for k, v in blessed.items() if k != "i0"}, tolerance=0.01,
                                  alpha=0.05, definition="d")


def test_paired_no_regression_fails_a_baseline_without_items(tmp_path):
    gate, _ = make_gate(tmp_path, bless=True)
    gate.no_regression("f1", 0.9, tolerance=0.01)  # an entry blessed before per-item scores were kept
    gate.context.store.commit()
    gate, _ = make_gate(tmp_path)
    with pytest.raises(GateFailure, match=r"has no per-item scores.*re-bless it"):
        gate.paired_no_regression("f1", {"a": 0.9}, tolerance=0.01, alpha=0.05, definition="d")


def test_ci_variable_counts_only_true_values():
    from distillgates.gates.session import ci_variable

    assert ci_variable({"CI": "false"}) is None and ci_variable({"CI": "0"}) is None and ci_variable({}) is None
    assert ci_variable({"CI": "true"}) == "CI=true" and ci_variable({"GITLAB_CI": "TRUE"}) == "GITLAB_CI=TRUE"
    assert ci_variable({"CI": "no", "TF_BUILD": "True"}) == "TF_BUILD=True"
