"""Statistics of the gates: speed quantile comparisons, paired quality drift, intervals of quality figures.

Speed (a gate tests the statistic it gates). Each speed gate compares one quantile of one metric
between the reference and the candidate arm: TTFT p50 and p95, TPS p50 and p5 (for a rate the
slow tail is the *low* quantile). The effect is the quantile ratio ``slowdown``, oriented so
that > 1 is worse for both kinds (candidate / reference for times, reference / candidate for
rates).

The unit of replication is the worker *process*, not the sample. A process keeps a speed offset
for its whole life (measured on the 2-core CI VM: the TPS of two processes of the same code and
model differs by 7% (sd of the log ratio) and the two halves of one process's samples agree;
children forked from one parent share its offset, so only fresh processes draw a new one). Samples
of one process are therefore not independent evidence about the code, and an interval over samples
alone is too narrow: it read an A/A difference between two processes as a significant regression.
So each arm measures several fresh worker processes (``groups``): in ``ab`` mode group ``k`` of the
two arms is one *pair* of processes measured back to back in interleaved blocks, and the per-pair
log quantile ratios are the observations (a one-sample t test, ``K - 1`` degrees of freedom); in
``stored`` mode the per-process log quantiles of the candidate are compared with those stored at
bless time (Welch's t test). The estimate is the geometric mean of the per-process ratios.
Decision rule, ``threshold`` = the hardware profile's ``max_regression``:

- ``fail``: the estimate is beyond the threshold (``slowdown > 1 + threshold``) **and** the
  slowdown is significant (the lower end of the one-sided interval is above 1);
- ``inconclusive``: the estimate is beyond the threshold but not significant (a large slowdown
  the noise cannot confirm). The sequential driver then measures one more round (more processes),
  up to a bound of looks, and reports ``inconclusive`` with its reason rather than guessing;
- ``pass``: the estimate is within the threshold. The interval is reported with it; how large a
  regression passes unnoticed is the gate's power, measured on the real path
  (``benchmarks/bench_speed_gate_power.py``, docs/gates.md), not claimed per session.

False alarms are controlled for the whole session: Bonferroni over the ``n_gates`` speed gates
and the ``looks`` of the sequential test (each look of each gate tests at
``alpha / (n_gates * looks)``; the union bound holds whatever the stopping rule). A fail needs
significance at that level, so with no change the chance that *any* speed gate of the session
fails is at most ``alpha``.

A claimed gain (the speculative speedup, :func:`compare_speedup`) is decided the other way round:
each process measured both arms, its log quantile ratio is the observation, and the gain passes
only when the interval shows it, fails when the interval shows it short, else is inconclusive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from scipy import stats

MIN_SAMPLES = 5  # per process: below this no quantile is taken
MIN_GROUPS = 2  # processes per arm: one gives no spread between processes


@dataclass(frozen=True)
class SpeedComparison:
    """Outcome of comparing one quantile of the candidate's processes with the reference's."""

    verdict: str  # "pass" | "fail" | "inconclusive" | "stopped" (the session ended the measurement before a decision)
    slowdown: float  # geometric mean of the per-process quantile ratios, > 1 is worse
    ci_low: float  # t interval of the slowdown, two-sided level 1 - 2 * test_alpha
    ci_high: float
    p_value: float  # one-sided test of H0 "no slowdown" (slowdown <= 1)
    threshold: float  # tolerated regression (0.05 = 5%)
    quantile: float  # 0.5, 0.95 (TTFT) or 0.05 (TPS)
    test_alpha: float  # one-sided level of this test (the session's alpha split over gates and looks)
    n_reference: int  # samples
    n_candidate: int
    groups_reference: int  # worker processes
    groups_candidate: int
    paired: bool  # ab mode: group k of both arms measured back to back
    rounds: int = 1  # measurement rounds (looks) used
    reason: str = ""

    @property
    def regression(self) -> float:
        """Relative regression (0.10 = 10% slower / lower throughput)."""
        return self.slowdown - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "regression": self.regression}


def _log_quantiles(name: str, groups: Sequence[Sequence[float]], quantile: float) -> np.ndarray:
    """Log of ``quantile`` of each group (process) of samples."""
    if len(groups) < MIN_GROUPS:
        raise ValueError(f"{name}: need samples of at least {MIN_GROUPS} worker processes, got {len(groups)} "
                         f"(more processes per round: --speed-workers)")
    out = []
    for k, group in enumerate(groups):
        array = np.asarray(group, dtype=np.float64)
        if array.ndim != 1 or array.size < MIN_SAMPLES:
            raise ValueError(f"{name} process {k}: need a flat list of at least {MIN_SAMPLES} samples, got shape "
                             f"{array.shape}")
        if not np.all(np.isfinite(array)) or np.any(array <= 0):
            raise ValueError(f"{name} process {k}: samples must be finite and > 0, got min={array.min()!r}")
        out.append(np.log(np.quantile(array, quantile)))
    return np.asarray(out)


def session_test_alpha(alpha: float, n_gates: int, looks: int) -> float:
    """Per-test one-sided level: ``alpha`` (the session's false-alarm bound) split over gates and looks."""
    if not 0.0 < alpha < 0.5 or n_gates < 1 or looks < 1:
        raise ValueError(f"need 0 < alpha < 0.5, n_gates >= 1, looks >= 1; got {alpha}, {n_gates}, {looks}")
    return alpha / (n_gates * looks)


def compare_quantiles(
    reference: Sequence[Sequence[float]],
    candidate: Sequence[Sequence[float]],
    *,
    threshold: float,
    higher_is_better: bool,
    quantile: float = 0.5,
    test_alpha: float = 0.05,
    paired: bool = True,
) -> SpeedComparison:
    """Compare one quantile between the arms' worker processes; see the module docstring for the rule.

    Args:
        reference, candidate: samples per worker process (a list per process). With ``paired``, equally
            many processes, process ``k`` of both arms measured back to back (interleaved A/B): the test is
            on the per-pair log ratios, so the machine's drift, shared within a pair, cancels. Without
            (``stored`` mode): Welch's t test between the arms' per-process log quantiles.

    Raises:
        ValueError: fewer than two processes or five samples per process, non-positive samples, unequal
            process counts when paired, or impossible settings.
    """
    if not 0.0 < test_alpha < 0.5 or threshold < 0 or not 0.0 < quantile < 1.0:
        raise ValueError(f"need 0 < test_alpha < 0.5, threshold >= 0, 0 < quantile < 1; got {test_alpha}, "
                         f"{threshold}, {quantile}")
    ref, cand = _log_quantiles("reference", reference, quantile), _log_quantiles("candidate", candidate, quantile)
    sign = -1.0 if higher_is_better else 1.0  # log slowdown > 0 is worse
    level = 1.0 - 2.0 * test_alpha  # each tail holds test_alpha: the one-sided decisions
    if paired:
        if ref.size != cand.size:
            raise ValueError(f"paired processes: {ref.size} reference and {cand.size} candidate processes")
        diff = sign * (cand - ref)  # (K,) log slowdown of each pair
        estimate = float(diff.mean())
        if float(diff.std()) == 0.0:  # no spread to test against: the change is exact
            p_value, low, high = (0.0 if estimate > 0 else 1.0), estimate, estimate
        else:
            result = stats.ttest_1samp(diff, 0.0, alternative="greater")
            ci = stats.ttest_1samp(diff, 0.0).confidence_interval(confidence_level=level)
            p_value, low, high = float(result.pvalue), float(ci.low), float(ci.high)
        test = f"t test of {ref.size} process pairs' log ratios"
    else:
        estimate = float(sign * (cand.mean() - ref.mean()))
        if float(np.concatenate([cand - cand.mean(), ref - ref.mean()]).std()) == 0.0:
            p_value, low, high = (0.0 if estimate > 0 else 1.0), estimate, estimate
        else:
            a, b = (cand, ref) if sign > 0 else (ref, cand)
            result = stats.ttest_ind(a, b, equal_var=False, alternative="greater")
            ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence_level=level)
            p_value, low, high = float(result.pvalue), float(ci.low), float(ci.high)
        test = f"Welch t test of {cand.size} candidate vs {ref.size} stored processes"
    slowdown, ci_low, ci_high = float(np.exp(estimate)), float(np.exp(low)), float(np.exp(high))
    n_ref, n_cand = sum(len(g) for g in reference), sum(len(g) for g in candidate)
    numbers = (
        f"q{quantile:g} slowdown {slowdown:.4f} (regression {slowdown - 1:+.2%}, threshold {threshold:.0%}), "
        f"{level:.2%} CI [{ci_low:.4f}, {ci_high:.4f}], p={p_value:.3g} ({test}), n={n_ref}/{n_cand} samples "
        f"(reference/candidate)"
    )
    limit = 1.0 + threshold
    if slowdown <= limit:
        verdict, why = "pass", f"within threshold: {numbers}"
    elif p_value < test_alpha:
        verdict, why = "fail", f"significant regression beyond threshold: {numbers}"
    else:
        verdict, why = "inconclusive", f"regression beyond threshold but not significant: {numbers}"
    return SpeedComparison(verdict, slowdown, ci_low, ci_high, p_value, threshold, quantile, test_alpha, n_ref,
                           n_cand, ref.size, cand.size, paired, 1, why)


@dataclass(frozen=True)
class SpeedupComparison:
    """Outcome of a claimed gain (speculative decoding over plain decoding), measured per worker process."""

    verdict: str  # "pass" | "fail" | "inconclusive"
    speedup: float  # geometric mean over processes of quantile(treated) / quantile(baseline), > 1 is faster
    ci_low: float  # t interval over processes, two-sided level 1 - 2 * test_alpha
    ci_high: float
    minimum: float  # the speedup the gate asks for
    quantile: float
    test_alpha: float  # one-sided level of each decision
    groups: int  # worker processes
    n_baseline: int  # samples
    n_treated: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_speedup(baseline: Sequence[Sequence[float]], treated: Sequence[Sequence[float]], *, minimum: float,
                    quantile: float = 0.5, test_alpha: float = 0.05) -> SpeedupComparison:
    """Decide whether a rate (TPS) gains at least ``minimum`` x, from processes that measured both arms.

    Process ``k`` measured the ``baseline`` and the ``treated`` arm interleaved (one process, so its speed
    offset cancels in its ratio); the observations are the per-process log quantile ratios, as in the paired
    speed gates (a t interval, ``K - 1`` degrees of freedom). A gain is a claim, so it must be shown:

    - ``pass``: the interval's lower end is at least ``minimum`` (significant at ``test_alpha``);
    - ``fail``: its upper end is below ``minimum`` (the shortfall is significant);
    - ``inconclusive``: the interval holds ``minimum``: the samples cannot tell.

    Raises:
        ValueError: fewer than :data:`MIN_GROUPS` processes or :data:`MIN_SAMPLES` samples per process, unequal
            process counts, non-positive samples, or impossible settings.
    """
    if not 0.0 < test_alpha < 0.5 or not minimum >= 0 or not 0.0 < quantile < 1.0:
        raise ValueError(f"need 0 < test_alpha < 0.5, minimum >= 0, 0 < quantile < 1; got {test_alpha}, {minimum}, "
                         f"{quantile}")
    if len(baseline) != len(treated):
        raise ValueError(f"{len(baseline)} baseline and {len(treated)} treated processes: each process measures "
                         f"both arms")
    base, gain = _log_quantiles("baseline", baseline, quantile), _log_quantiles("treated", treated, quantile)
    ratios = gain - base  # (K,) log speedup of each process
    interval = mean_interval(ratios.tolist(), alpha=2.0 * test_alpha)
    assert interval is not None  # at least MIN_GROUPS processes
    speedup, low, high = float(np.exp(ratios.mean())), float(np.exp(interval.low)), float(np.exp(interval.high))
    numbers = (f"q{quantile:g} speedup {speedup:.4f} (geometric mean over {ratios.size} processes), "
               f"{1 - 2 * test_alpha:.0%} CI [{low:.4f}, {high:.4f}], minimum {minimum:g}, "
               f"n={sum(len(g) for g in baseline)}/{sum(len(g) for g in treated)} samples (baseline/treated)")
    if low >= minimum:
        verdict, why = "pass", f"speedup shown (the interval's lower end >= minimum): {numbers}"
    elif high < minimum:
        verdict, why = "fail", f"speedup below the minimum (the interval's upper end < minimum): {numbers}"
    else:
        verdict, why = "inconclusive", f"the samples cannot tell (the interval holds the minimum): {numbers}"
    return SpeedupComparison(verdict, speedup, low, high, minimum, quantile, test_alpha, int(ratios.size),
                             sum(len(g) for g in baseline), sum(len(g) for g in treated), why)


class MeasurementStopped(Exception):
    """Raised by a sequential test's ``samples_after`` when no further round will be measured (the session
    already failed another gate); the test then ends undecided ("stopped") at its last look."""


def sequential_speed_gate(
    samples_after: Callable[[int], tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]]],
    *,
    looks: int,
    threshold: float,
    higher_is_better: bool,
    quantile: float = 0.5,
    alpha: float = 0.05,
    n_gates: int = 1,
    paired: bool = True,
) -> SpeedComparison:
    """Decide after 1, 2, ... ``looks`` rounds, stopping at the first pass or fail, or undecided ("stopped") when
    ``samples_after`` raises :class:`MeasurementStopped` for a later look.

    Stopping early never changes a session's verdict: it happens only after another gate of the session failed.

    Args:
        samples_after: ``k -> (reference, candidate)`` samples per process of exactly the first ``k`` rounds
            (the caller measures a round when first asked for it, and may have measured more for other gates).
        alpha: the session's false-alarm bound, split over ``n_gates`` gates and ``looks`` looks.
    """
    test_alpha = session_test_alpha(alpha, n_gates, looks)
    result: SpeedComparison | None = None
    stopped: MeasurementStopped | None = None
    for look in range(1, looks + 1):
        try:
            reference, candidate = samples_after(look)
        except MeasurementStopped as err:
            if result is None:
                raise
            stopped, look = err, look - 1
            break
        result = compare_quantiles(reference, candidate, threshold=threshold, higher_is_better=higher_is_better,
                                   quantile=quantile, test_alpha=test_alpha, paired=paired)
        if result.verdict != "inconclusive":
            break
    assert result is not None
    reason = (f"{result.reason}; look {look} of at most {looks} (rounds of worker processes; alpha {alpha:g} split "
              f"over {n_gates} gate(s) x {looks} look(s))")
    if stopped is not None:
        return replace(result, verdict="stopped", rounds=look, reason=f"{stopped}; undecided at {reason}")
    if result.verdict == "inconclusive":
        reason += " — the bound of rounds is reached"
    return replace(result, rounds=look, reason=reason)


# -- quality drift: paired per-item comparison -----------------------------------------------


@dataclass(frozen=True)
class PairedChange:
    """Outcome of comparing per-item scores of a run with the blessed ones, item by item.

    Both arms score the same items, so the item-to-item spread (some items are hard for every
    model) cancels in the differences: the test sees only how the model changed.
    """

    verdict: str  # "pass" | "fail"
    n: int  # items compared
    n_changed: int  # items whose score changed
    mean_change: float  # mean of current - blessed, > 0 is better
    ci_low: float  # t interval of the mean change (two-sided level 1 - 2 * alpha: ci_high is the one-sided bound)
    ci_high: float
    p_value: float  # one-sided paired t-test of H0 "mean change >= -tolerance"
    tolerance: float  # tolerated drop of the mean (absolute)
    alpha: float
    reason: str
    detectable_drop: float = math.inf  # smallest mean drop the test calls at this n and spread (inf: none)
    spread: float = 0.0  # the per-item spread detectable_drop assumes
    underpowered: bool = False  # the gate cannot detect a drop of POWER_FACTOR x the tolerance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


POWER_FACTOR = 3.0  # a drift gate that cannot detect a drop of 3x its tolerance is underpowered


def detectable_drop(blessed: Sequence[float], change: Sequence[float], *, tolerance: float,
                    alpha: float) -> tuple[float, float]:
    """(the smallest mean drop the one-sided paired t-test of :func:`compare_paired` calls, the spread it assumes).

    The drop at which the test statistic reaches its critical value, ``tolerance + t(1 - alpha, n - 1) * s / sqrt(n)``
    (a true drop of that size is called about half the time; the test has no power below it). ``s``, the spread of
    the per-item changes a regression would bring, is the largest of: the observed changes' standard deviation,
    the blessed per-item scores' (a regression moves items by amounts of the order of their spread), and
    ``1 / sqrt(n)`` (one item of n losing a score of 1 entirely). One item: no spread to test against, inf.
    """
    n = len(change)
    if n < 2:
        return math.inf, 0.0
    spread = max(float(np.std(change, ddof=1)), float(np.std(blessed, ddof=1)), 1.0 / math.sqrt(n))
    return tolerance + float(stats.t.ppf(1.0 - alpha, n - 1)) * spread / math.sqrt(n), spread


def items_for_tolerance(spread: float, tolerance: float, alpha: float = 0.05, factor: float = POWER_FACTOR) -> int:
    """The smallest n at which a drift gate of ``tolerance`` detects a drop of ``factor`` x the tolerance
    (:func:`detectable_drop`), for per-item scores of standard deviation ``spread`` (docs/gates.md: sizing an
    eval set)."""
    if tolerance <= 0 or factor <= 1:
        raise ValueError(f"need tolerance > 0 and factor > 1; got {tolerance}, {factor}")
    n = 2
    while tolerance + float(stats.t.ppf(1.0 - alpha, n - 1)) * max(spread, 1.0 / math.sqrt(n)) / math.sqrt(n) > \
            factor * tolerance:
        n += 1
    return n


def compare_paired(blessed: Mapping[str, float], current: Mapping[str, float], *, tolerance: float,
                   alpha: float = 0.05) -> PairedChange:
    """Fail only when the mean per-item change is significantly below ``-tolerance``.

    The gated figure is a mean over items (macro F1), so the test is on the mean of the per-item
    changes: a one-sided paired t-test of H0 "mean change >= -tolerance" (equivalently, the upper
    end of the one-sided 1 - alpha interval of the mean change lies below ``-tolerance``). A drop
    beyond the tolerance that the items cannot tell from noise passes, saying so. Without spread
    (one item, or every item changed by the same amount) there is no noise to test against: the
    change is exact, and more than one item dropping beyond the tolerance fails.

    Args:
        blessed: per-item scores at bless time, by item id.
        current: per-item scores of the gated run, by item id; must hold the same ids.

    Raises:
        ValueError: the id sets differ, no item, a non-finite score, or impossible settings.
    """
    if set(blessed) != set(current):
        missing, extra = sorted(set(blessed) - set(current)), sorted(set(current) - set(blessed))
        raise ValueError(f"per-item scores cover other items than the blessed ones: {len(missing)} blessed items "
                         f"not in the run {missing[:5]}, {len(extra)} run items not blessed {extra[:5]}")
    if not blessed:
        raise ValueError("no per-item scores to compare")
    if not 0.0 < alpha < 0.5 or tolerance < 0:
        raise ValueError(f"need 0 < alpha < 0.5 and tolerance >= 0; got {alpha}, {tolerance}")
    ids = sorted(blessed)
    change = np.array([current[i] - blessed[i] for i in ids], dtype=np.float64)  # (n,) > 0 is better
    if not np.all(np.isfinite(change)):
        raise ValueError("per-item scores must be finite numbers")
    n_changed = int(np.count_nonzero(change))
    mean = float(change.mean())
    if change.size > 1 and float(change.std()) > 0.0:
        p_value = float(stats.ttest_1samp(change, -tolerance, alternative="less").pvalue)
        ci = stats.ttest_1samp(change, 0.0).confidence_interval(confidence_level=1.0 - 2.0 * alpha)
        ci_low, ci_high = float(ci.low), float(ci.high)
    else:
        p_value = 0.0 if change.size > 1 and mean < -tolerance else 1.0
        ci_low = ci_high = mean
    numbers = (f"n={change.size} items ({n_changed} changed), mean change {mean:+.4f}, "
               f"{100 * (1 - 2 * alpha):g}% CI [{ci_low:+.4f}, {ci_high:+.4f}], p={p_value:.3g} (one-sided paired "
               f"t-test of mean change >= -{tolerance:g}, alpha {alpha})")
    drop, spread = detectable_drop([blessed[i] for i in ids], change.tolist(), tolerance=tolerance, alpha=alpha)
    underpowered = not drop <= POWER_FACTOR * tolerance
    numbers += (f"; detectable drop {drop:.4f} at n={change.size}, spread {spread:.3f}"
                + (f" (UNDERPOWERED: cannot detect {POWER_FACTOR:g}x the tolerance, {POWER_FACTOR * tolerance:g})"
                   if underpowered else ""))
    if p_value < alpha:
        verdict, why = "fail", f"significant drop beyond tolerance: {numbers}"
    elif mean < -tolerance:
        verdict, why = "pass", f"drop beyond tolerance but within noise (not significant): {numbers}"
    else:
        verdict, why = "pass", f"within tolerance: {numbers}"
    return PairedChange(verdict, change.size, n_changed, mean, ci_low, ci_high, p_value, tolerance, alpha, why,
                        drop, spread, underpowered)


# -- n and confidence interval of a measured quality figure ------------------------------------


@dataclass(frozen=True)
class Interval:
    """A measured figure's sample size and two-sided confidence interval (level ``1 - alpha``)."""

    n: int
    low: float
    high: float


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> Interval | None:
    """Wilson score interval of a rate ``successes / n`` (None when n is 0: the rate is undefined).
    Unlike the normal approximation it stays inside [0, 1] and is not degenerate at a rate of 1."""
    if n == 0:
        return None
    ci = stats.binomtest(successes, n).proportion_ci(confidence_level=1.0 - alpha, method="wilson")
    return Interval(n, float(ci.low), float(ci.high))


def mean_interval(values: Sequence[float], alpha: float = 0.05) -> Interval | None:
    """Student-t interval of a mean (e.g. macro F1 over items); None without values, a point with one."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return None
    mean = float(array.mean())
    if array.size == 1 or not np.all(np.isfinite(array)) or float(array.std()) == 0.0:
        return Interval(int(array.size), mean, mean)  # one value, or all equal: the point (t has no spread)
    ci = stats.ttest_1samp(array, 0.0).confidence_interval(confidence_level=1.0 - alpha)
    return Interval(int(array.size), float(ci.low), float(ci.high))


def rate_quantile_interval(rates: Sequence[float], quantile: float, alpha: float = 0.05) -> Interval | None:
    """Distribution-free interval of the ``quantile`` of per-item rates in [0, 1] (``scipy.stats.quantile_test``'s
    order-statistic interval); an end the items cannot bound (too few of them) is the range's end, 0 or 1. None
    without rates."""
    array = np.asarray(rates, dtype=np.float64)
    if array.size == 0:
        return None
    ci = stats.quantile_test(array, q=float(np.quantile(array, quantile)), p=quantile).confidence_interval(
        confidence_level=1.0 - alpha)
    low, high = float(ci.low), float(ci.high)
    return Interval(int(array.size), 0.0 if np.isnan(low) else low, 1.0 if np.isnan(high) else high)


def corrected_ratio(
    y: Sequence[float], x: Sequence[float], dy: Sequence[float], dx: Sequence[float], base: Interval | None,
    alpha: float = 0.05,
) -> tuple[float | None, Interval | None]:
    """A ratio measured on a random sample only (the costly measurement), estimated over all ``N`` items: the cheap
    measurement's ``sum(y) / sum(x)`` over the ``N`` items, corrected by the costly-minus-cheap differences ``dy``,
    ``dx`` of the ``n`` sampled items (the difference estimator of survey sampling; the mean of prediction-powered
    inference, Angelopoulos et al. 2023): ``(sum(y) + N/n sum(dy)) / (sum(x) + N/n sum(dx))``.
    Unbiased for the costly ratio over the ``N`` items (to first order in the ratio), and as precise as the cheap one
    where the two agree on the sample.

    The interval: ``base`` (the cheap ratio's own, e.g. Wilson), moved to the estimate and widened in quadrature by
    the correction's t interval (the delta method over the sample's differences); ``base`` itself when every
    difference is 0. Estimate and interval are clipped to [0, 1] (rates, F1). ``(None, None)`` when the estimated
    denominator is not positive; the interval is None without ``base`` or with fewer than 2 sampled items."""
    y_, x_, dy_, dx_ = (np.asarray(v, dtype=np.float64) for v in (y, x, dy, dx))
    scale = y_.size / dy_.size if dy_.size else 0.0
    total = float(x_.sum() + scale * dx_.sum())
    if total <= 0.0:
        return None, None
    estimate = float(y_.sum() + scale * dy_.sum()) / total
    clip = min(max(estimate, 0.0), 1.0)
    if base is None or dy_.size < 2 or x_.sum() <= 0.0:
        return clip, None
    cheap = float(y_.sum() / x_.sum())
    spread = float(np.std(dy_ - estimate * dx_, ddof=1))  # linearized differences of the ratio
    half = float(stats.t.ppf(1.0 - alpha / 2, dy_.size - 1)) * y_.size / total * spread / math.sqrt(dy_.size)
    low = estimate - math.hypot(cheap - base.low, half)
    high = estimate + math.hypot(base.high - cheap, half)
    return clip, Interval(base.n, min(max(low, 0.0), 1.0), min(max(high, 0.0), 1.0))
