"""Gate verdicts independent of pytest.

A :class:`Gate` is bound to one test (node id, group). Each check compares a measured value
with a threshold and/or a blessed baseline, records a :class:`GateRecord` (measured value,
threshold, baseline, verdict, reason) through a ``record`` callback (the plugin passes
``record_property``), and raises :class:`GateFailure` with every number in the message — CI
systems that show no JUnit properties (GitLab) still show why a gate failed.
"""

from __future__ import annotations

import datetime as dt
import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from distillgates.eval.fingerprints import FingerprintError, check_fingerprints
from distillgates.gates.baselines import BaselineEntry, BaselineError, BaselineStore
from distillgates.gates.references import StaleReference
from distillgates.gates.stats import Interval, compare_paired, compare_speedup, mean_interval, sequential_speed_gate
from distillgates.speed_worker import WorkerError

if TYPE_CHECKING:
    from distillgates.gates.speed_ab import SpeedRounds


class GateFailure(AssertionError):
    """A gate's criterion is violated."""


class GateInconclusive(Exception):
    """A speed gate could not decide within its measurement bound (reported, not guessed)."""


class GateStopped(Exception):
    """A speed gate was not decided because another gate of the session failed first (a skip, never a pass)."""


class GateNotMeasured(Exception):
    """A gate had nothing to decide on (an empty slice, an underpowered drift gate) outside CI, or waived: a skip
    with the reason, never a pass. ``verdict``: "not measured" or "underpowered"."""

    def __init__(self, message: str, verdict: str = "not measured") -> None:
        super().__init__(message)
        self.verdict = verdict


@dataclass
class GateRecord:
    """One check of one gate, as it appears in JUnit properties and the gate reports."""

    nodeid: str
    group: str
    name: str
    measured: Any
    threshold: Any = None
    comparison: str = ""  # ">=", "<=", "==", "no_regression", "speed_no_regression"
    baseline: Any = None
    verdict: str = "pass"  # pass | fail | inconclusive | stopped | blessed | not measured | underpowered
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    n: int | None = None  # sample size behind ``measured`` (items, calls), when it is an estimate
    ci: list[float] | None = None  # two-sided confidence interval of ``measured`` ([low, high])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SpeedSettings:
    samples: int = 24  # samples per worker process and arm
    workers: int = 6  # fresh worker processes per arm and measurement round
    max_extra_rounds: int = 3  # extra rounds while a gate is inconclusive (looks = 1 + this)
    mode: str = "ab"  # "ab": interleaved against the blessed reference; "stored": vs the samples stored at bless

    def __post_init__(self) -> None:
        if self.mode not in ("ab", "stored"):
            raise ValueError(f"speed mode must be 'ab' or 'stored', got {self.mode!r}")

    @property
    def looks(self) -> int:
        return 1 + self.max_extra_rounds


@dataclass
class GateContext:
    """Session-wide state every gate shares (built once by the plugin)."""

    store: BaselineStore
    bless: bool = False
    allow_cross_hw: bool = False
    allow_other_eval_set: bool = False  # compare with baselines blessed on another eval set
    hardware_mismatch: str | None = None  # why the detected hardware does not match the profile
    run_fingerprints: dict[str, Any] | None = None  # the gated run report's header.fingerprints
    provenance: dict[str, Any] = field(default_factory=dict)  # git sha, config, run dir, hardware header
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    bless_command: Callable[[str], str] = lambda nodeid: f"pytest --bless '{nodeid}'"
    records: list[GateRecord] = field(default_factory=list)
    ci: str | None = None  # the CI variable set true (e.g. "CI=true"): an unmeasured gate fails unless waived
    # check name -> the thresholds file that waives it (called when a gate measured nothing: thresholds load lazily)
    waived: Callable[[], dict[str, str]] = dict


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def _interval_fields(interval: Interval | None) -> dict[str, Any]:
    """``GateRecord`` keyword arguments ``n`` and ``ci`` of an estimated value (none without an interval)."""
    return {} if interval is None else {"n": interval.n, "ci": [interval.low, interval.high]}


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class Gate:
    """Assertion helpers of one gate test; see the module docstring."""

    def __init__(self, context: GateContext, nodeid: str, group: str,
                 record: Callable[[str, Any], None] = lambda name, value: None) -> None:
        self.context = context
        self.nodeid = nodeid
        self.group = group
        self._record = record

    # -- recording -------------------------------------------------------------------

    def _finish(self, rec: GateRecord) -> GateRecord:
        __tracebackhide__ = True
        self.context.records.append(rec)
        for key in ("measured", "n", "ci", "threshold", "baseline", "verdict", "reason"):
            value = getattr(rec, key)
            if value is not None:
                self._record(f"{rec.name}.{key}", value)
        if rec.verdict == "fail":
            raise GateFailure(
                f"gate {self.group}/{rec.name} FAILED: measured {_fmt(rec.measured)} {rec.comparison} "
                f"threshold {_fmt(rec.threshold)}, baseline {_fmt(rec.baseline)} — {rec.reason}"
            )
        if rec.verdict == "inconclusive":
            raise GateInconclusive(f"gate {self.group}/{rec.name} INCONCLUSIVE: {rec.reason}")
        if rec.verdict in ("not measured", "underpowered"):
            raise GateNotMeasured(f"gate {self.group}/{rec.name}: {rec.reason}", rec.verdict)
        if rec.verdict == "stopped":
            raise GateStopped(f"gate {self.group}/{rec.name} NOT DECIDED: {rec.reason}; run it alone to decide it: "
                              f"pytest '{self.nodeid}' -m speed")
        return rec

    def unmeasured(self, name: str, why: str, value: Any = None, threshold: Any = None, comparison: str = "",
                   n: int | None = None, details: dict[str, Any] | None = None, *, label: str = "not measured",
                   baseline: Any = None, ci: list[float] | None = None) -> GateRecord:
        """``name`` decides nothing (``why``: e.g. "not measured (0 items)"; ``label``: "not measured" or
        "underpowered"): under CI a fail unless the thresholds' ``waive`` names it, else (or waived) reported as
        ``label`` and skipped. Never a pass."""
        __tracebackhide__ = True
        waived = self.context.waived()
        if name in waived:
            verdict, why = label, f"{why}; waived by {waived[name]} (gates.waive)"
        elif self.context.ci:
            verdict, why = "fail", f"{why}; fails under CI ({self.context.ci}) unless gates.waive names {name!r}"
        else:
            verdict, why = label, f"{why}; fails under CI unless gates.waive names {name!r}"
        return self._finish(GateRecord(self.nodeid, self.group, name, value, threshold, comparison, baseline, verdict,
                                       why, details or {}, n=n, ci=ci))

    def over(self, name: str, n: int | None, what: str) -> None:
        """Before gating ``name``: it is over ``n`` eval items ``what`` (e.g. "holding PII"); 0 is "not measured
        (0 items)" (:meth:`unmeasured`), never a pass over nothing. None (a report without the count) fails."""
        __tracebackhide__ = True
        if n is None:
            self._finish(GateRecord(self.nodeid, self.group, name, None, None, "", None, "fail",
                                    f"the report does not count the eval items {what} (written before slice "
                                    "counts; re-run the eval and report steps)"))
        if n == 0:
            self.unmeasured(name, f"not measured (0 items): no eval item {what}", n=0)

    def measured_on(self, name: str, key: str | None, what: str) -> None:
        """Before gating a figure one machine measured (Core ML parity, ANE residency): fail, naming both, when its
        hardware profile ``key`` is not the session's (``--hw-profile`` or detected), unless ``--allow-cross-hw``."""
        __tracebackhide__ = True
        profile = self.context.store.profile
        if key == profile or self.context.allow_cross_hw:
            return
        self._finish(GateRecord(self.nodeid, self.group, name, key, profile, "==", None, "fail",
                                f"{what} was measured on hardware profile {key!r}, this session gates hardware profile "
                                f"{profile!r}: a figure is bound to the machine that measured it (export on a "
                                f"{profile} machine, or pass --allow-cross-hw)"))

    def _check(self, name: str, value: Any, threshold: Any, comparison: str, ok: bool, definition: str,
               interval: Interval | None = None, n: int | None = None) -> GateRecord:
        __tracebackhide__ = True
        if value is None or (isinstance(value, numbers.Real) and not math.isfinite(value)):
            ok = False  # missing, NaN or ±inf never satisfies a gate: a broken model must not pass by a quirk
        why = f"{name} = {_fmt(value)} {'satisfies' if ok else 'violates'} {comparison} {_fmt(threshold)}"
        if interval is not None:
            why += f" (n={interval.n}, 95% CI [{interval.low:.4g}, {interval.high:.4g}])"
        if interval is None and n is not None:
            why += f" (n={n})"
        rec = GateRecord(self.nodeid, self.group, name, value, threshold, comparison, None,
                         "pass" if ok else "fail", why + (f" ({definition})" if definition else ""),
                         **(_interval_fields(interval) if interval is not None else {"n": n}))
        return self._finish(rec)

    # -- absolute checks ----------------------------------------------------------------

    def at_least(self, name: str, value: float, threshold: float, definition: str = "",
                 interval: Interval | None = None, n: int | None = None) -> GateRecord:
        """Pass when ``value >= threshold``; a NaN or infinite threshold passes nothing (it bounds nothing).
        ``interval`` (n and confidence interval of an estimated ``value``), or ``n`` (the items a count or a
        median is over), is recorded and shown, not gated on."""
        __tracebackhide__ = True
        ok = _is_finite_number(threshold) and value is not None and value >= threshold
        return self._check(name, value, threshold, ">=", ok, definition, interval, n)

    def at_most(self, name: str, value: float, threshold: float, definition: str = "",
                interval: Interval | None = None, n: int | None = None) -> GateRecord:
        """Pass when ``value <= threshold``; a NaN or infinite threshold passes nothing (it bounds nothing)."""
        __tracebackhide__ = True
        ok = _is_finite_number(threshold) and value is not None and value <= threshold
        return self._check(name, value, threshold, "<=", ok, definition, interval, n)

    def speedup_at_least(self, name: str, baseline: list[list[float]], treated: list[list[float]], minimum: float, *,
                         alpha: float, definition: str) -> GateRecord:
        """Pass when the speedup of ``treated`` over ``baseline`` (TPS samples per worker process, each process
        measured both) is shown to be at least ``minimum``; fail when it is shown below; else inconclusive
        (:func:`distillgates.gates.stats.compare_speedup`, one-sided level ``alpha`` each way)."""
        __tracebackhide__ = True
        try:
            result = compare_speedup(baseline, treated, minimum=minimum, test_alpha=alpha)
        except (ValueError, TypeError) as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, None, minimum, ">=", None, "fail",
                                           f"{name}: cannot decide from the recorded samples: {err} ({definition})"))
        return self._finish(GateRecord(self.nodeid, self.group, name, result.speedup, minimum, ">=", None,
                                       result.verdict, f"{name}: {result.reason} ({definition})", result.to_dict(),
                                       n=result.groups))  # its interval (level 1 - 2 alpha) is in the reason

    def equals(self, name: str, value: Any, expected: Any, definition: str = "") -> GateRecord:
        __tracebackhide__ = True
        return self._check(name, value, expected, "==", value == expected, definition)

    # -- baseline checks ----------------------------------------------------------------

    def _baseline(self, key: str, hardware_dependent: bool) -> BaselineEntry:
        __tracebackhide__ = True
        if hardware_dependent and self.context.hardware_mismatch and not self.context.allow_cross_hw:
            raise BaselineError(f"{self.context.hardware_mismatch} (pass --allow-cross-hw to compare anyway)")
        return self.context.store.load(
            self.group, key, hardware_dependent=hardware_dependent, run_fingerprints=self.context.run_fingerprints,
            allow_cross_hw=self.context.allow_cross_hw, allow_other_eval_set=self.context.allow_other_eval_set,
            bless_command=self.context.bless_command(self.nodeid),
        )

    def _refuse_bless(self, name: str, key: str, value: Any, hardware_dependent: bool,
                      samples: list[list[float]] | None) -> str | None:
        """Why ``value`` must not become the blessed baseline ``key`` (None: it may)."""
        if hardware_dependent and self.context.hardware_mismatch and not self.context.allow_cross_hw:
            # never write this machine's numbers under another machine's profile
            return self.context.hardware_mismatch
        if not _is_finite_number(value):
            return f"{self.group}/{key}: {name} = {value!r} is not a finite number"
        bad = [s for group in samples or [] for s in group if not _is_finite_number(s)]
        if bad:
            return f"{self.group}/{key}: {name} has non-finite samples {bad[:5]!r}"
        try:
            check_fingerprints(self.context.run_fingerprints, "the gated run's report header")
        except FingerprintError as err:
            return f"{self.group}/{key}: a baseline records the eval set it was measured on: {err}"
        return None

    def _bless(self, name: str, key: str, value: Any, definition: str, hardware_dependent: bool,
               samples: list[list[float]] | None = None, extra: dict[str, Any] | None = None,
               items: dict[str, float] | None = None) -> GateRecord:
        # non-finite item scores make a non-finite mean (``value``), which is refused
        refusal = self._refuse_bless(name, key, value, hardware_dependent, samples)
        if refusal:
            return self._finish(GateRecord(self.nodeid, self.group, name, value, None, "bless", None, "fail",
                                           f"refusing to bless: {refusal}"))
        provenance = {**self.context.provenance, "blessed_at": dt.datetime.now(dt.UTC).isoformat(), **(extra or {})}
        fingerprints = dict(self.context.run_fingerprints or {})
        entry = BaselineEntry(value, definition, samples, provenance, fingerprints, items=items)
        path = self.context.store.stage(self.group, key, entry, hardware_dependent=hardware_dependent)
        return self._finish(GateRecord(self.nodeid, self.group, name, value, None, "bless", value, "blessed",
                                       f"staged {key!r} for {path}", {"samples": samples}))

    def no_regression(self, name: str, value: float, baseline_key: str | None = None, *, tolerance: float,
                      higher_is_better: bool = True, definition: str = "",
                      hardware_dependent: bool = False) -> GateRecord:
        """Fail when ``value`` is worse than the blessed value by more than ``tolerance`` (absolute)."""
        __tracebackhide__ = True
        key = baseline_key or name
        if self.context.bless:
            return self._bless(name, key, value, definition, hardware_dependent)
        try:
            base = self._baseline(key, hardware_dependent)
        except BaselineError as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "no_regression", None,
                                           "fail", str(err)))
        if not _is_finite_number(value) or not _is_finite_number(base.value):
            return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "no_regression",
                                           base.value, "fail", f"{name} = {_fmt(value)} vs blessed "
                                           f"{_fmt(base.value)}: both must be finite numbers (None: not measured)"))
        delta = value - base.value if higher_is_better else base.value - value  # > 0 is better
        ok = delta >= -tolerance
        why = (f"{name} = {_fmt(value)} vs blessed {_fmt(base.value)}: change {delta:+.6g} "
               f"({'improvement' if delta >= 0 else 'regression'}), tolerated regression {tolerance:.6g}")
        return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "no_regression", base.value,
                                       "pass" if ok else "fail", why, {"delta": delta}))

    def paired_no_regression(self, name: str, items: dict[str, float], baseline_key: str | None = None, *,
                             tolerance: float, alpha: float, definition: str) -> GateRecord:
        """Paired quality drift gate on per-item scores (see :func:`distillgates.gates.stats.compare_paired`):
        fail when the mean per-item drop exceeds ``tolerance`` and is significant at ``alpha``.

        ``items`` maps item id to score; the measured value is their mean (None when there is no item,
        which fails). Blessing stores the per-item scores in the baseline entry.
        """
        __tracebackhide__ = True
        key = baseline_key or name
        value = float(np.mean(list(items.values()))) if items else None
        interval = _interval_fields(mean_interval(list(items.values())))
        if self.context.bless:
            return self._bless(name, key, value, definition, False, items=items)
        try:
            base = self._baseline(key, False)
        except BaselineError as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "paired_no_regression",
                                           None, "fail", str(err)))
        if not base.items:
            return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "paired_no_regression",
                                           base.value, "fail", f"{base.path}: entries.{key} has no per-item scores "
                                           f"(blessed before paired drift gates); re-bless it: "
                                           f"{self.context.bless_command(self.nodeid)}"))
        try:
            result = compare_paired(base.items, items, tolerance=tolerance, alpha=alpha)
        except ValueError as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "paired_no_regression",
                                           base.value, "fail", f"{name} vs {base.path}: entries.{key}: {err}"))
        if result.verdict == "pass" and result.underpowered:  # a pass it could not have failed: never a pass
            return self.unmeasured(name, f"underpowered: {result.reason} ({definition})", value, tolerance,
                                   "paired_no_regression", label="underpowered", baseline=base.value,
                                   details=result.to_dict(), **interval)
        return self._finish(GateRecord(self.nodeid, self.group, name, value, tolerance, "paired_no_regression",
                                       base.value, result.verdict, f"{name}: {result.reason} ({definition})",
                                       result.to_dict(), **interval))

    def speed_no_regression(self, name: str, speed: SpeedRounds, metric: str, baseline_key: str | None = None, *,
                            threshold: float, higher_is_better: bool, definition: str, quantile: float,
                            alpha: float, n_gates: int) -> GateRecord:
        """Statistical speed gate on one quantile of ``metric`` (see :mod:`distillgates.gates.stats`).

        ``speed`` holds the session's samples (:class:`distillgates.gates.speed_ab.SpeedRounds`): in ``ab`` mode
        the blessed reference (recorded in the baseline entry's provenance) is measured interleaved with the
        candidate; in ``stored`` mode the candidate is compared with the entry's stored samples. ``alpha`` is
        the session's false-alarm bound, split over ``n_gates`` speed gates and the looks of the sequential test.
        Blessing measures every round of the candidate and records the reference (artifacts, code).
        """
        __tracebackhide__ = True
        key = baseline_key or name
        if self.context.bless:
            try:
                groups = [[float(s) for s in group] for group in speed.after(speed.looks, metric)[1]]
                extra = speed.bless_record()
            except (StaleReference, WorkerError) as err:
                return self._finish(GateRecord(self.nodeid, self.group, name, None, None, "bless", None, "fail",
                                               f"refusing to bless: {err}"))
            samples = [s for group in groups for s in group]
            value = float(np.quantile(samples, quantile)) if samples else math.nan
            return self._bless(name, key, value, definition, True, groups, extra)
        try:
            base = self._baseline(key, True)
        except BaselineError as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, None, threshold, "speed_no_regression",
                                           None, "fail", str(err)))
        rebless = self.context.bless_command(self.nodeid)
        stored = base.samples or []

        def samples_after(rounds: int) -> tuple[list[Any], list[Any]]:
            reference, candidate = speed.after(rounds, metric)
            return (stored, candidate) if speed.mode == "stored" else (reference, candidate)

        try:
            if speed.mode == "ab":
                speed.use_reference(base.provenance.get("speed_reference"), rebless)
            elif not stored or not all(isinstance(group, list) for group in stored):
                raise StaleReference(f"baseline {self.group}/{key} has no raw samples per worker process (blessed "
                                     f"before they were kept); re-bless it: {rebless}")
            result = sequential_speed_gate(samples_after, looks=speed.looks, threshold=threshold,
                                           higher_is_better=higher_is_better, quantile=quantile, alpha=alpha,
                                           n_gates=n_gates, paired=speed.mode == "ab")
        except (StaleReference, WorkerError, ValueError) as err:
            return self._finish(GateRecord(self.nodeid, self.group, name, None, threshold, "speed_no_regression",
                                           base.value, "fail", f"{speed.mode} mode: {err}"))
        if result.verdict == "fail":
            speed.stop(f"{self.group}/{name} failed")
        reference_groups, candidate_groups = samples_after(result.rounds)
        reference = [s for group in reference_groups for s in group]
        candidate = [s for group in candidate_groups for s in group]
        return self._finish(GateRecord(
            self.nodeid, self.group, name, float(np.quantile(candidate, quantile)), threshold, "speed_no_regression",
            base.value, result.verdict, f"{speed.mode} mode: {result.reason}",
            {**result.to_dict(), "mode": speed.mode, "reference_samples": reference, "candidate_samples": candidate},
        ))
