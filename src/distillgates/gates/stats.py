"""Speed comparisons that do not cry wolf.

Shared machines vary by several percent from run to run, so a 5% gate on two single numbers
is a coin toss. A speed gate here compares *raw samples* and decides in three ways:

- ``fail``: the slowdown of the median (or of another quantile, e.g. p95) exceeds the
  threshold **and** the slowdown is significant (one-sided rank test p < alpha — Mann–Whitney
  U unpaired, Wilcoxon signed-rank on the log ratios when paired — and the bootstrap CI of
  the quantile ratio lies above 1);
- ``pass``: the slowdown is within the threshold and bounded: the CI's upper end is below
  twice the threshold (a noisy estimate that merely happens to land under the threshold while
  a large regression is still plausible does not pass);
- ``inconclusive``: anything else (a large but noisy slowdown, or a significant slowdown whose
  CI straddles the threshold). The sequential driver then measures more rounds (bounded) and
  reports ``inconclusive`` rather than guessing when still undecided.

"Slowdown" is oriented so that > 1 is worse for both kinds of metric: candidate / reference
for times (``ttft_ms``), reference / candidate for rates (``tps``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

MIN_SAMPLES = 5  # below this a rank test cannot reach p < 0.05 one-sided
Measure = Callable[[int], Sequence[float]]  # n -> n raw samples of one metric


@dataclass(frozen=True)
class SpeedComparison:
    """Outcome of comparing candidate samples with reference samples."""

    verdict: str  # "pass" | "fail" | "inconclusive"
    slowdown: float  # point estimate of the quantile (median) ratio, > 1 is worse
    ci_low: float  # bootstrap CI of the slowdown (two-sided level 1 - 2 * alpha)
    ci_high: float
    p_value: float  # one-sided: candidate worse than reference
    threshold: float  # tolerated regression (0.05 = 5%)
    alpha: float
    paired: bool
    n_reference: int
    n_candidate: int
    rounds: int = 1  # measurement rounds used (sequential driver)
    reason: str = ""

    @property
    def regression(self) -> float:
        """Relative regression (0.10 = 10% slower / lower throughput)."""
        return self.slowdown - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "regression": self.regression}


def _as_samples(name: str, values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size < MIN_SAMPLES:
        raise ValueError(f"{name}: need a flat list of at least {MIN_SAMPLES} samples, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise ValueError(f"{name}: samples must be finite and > 0, got min={array.min()!r}")
    return array


def quantile_slowdown(
    reference: np.ndarray, candidate: np.ndarray, higher_is_better: bool, quantile: float = 0.5, axis: int = -1
) -> np.ndarray:
    """Quantile ratio (median by default) oriented so that > 1 means the candidate is worse (vectorized)."""
    ratio = np.quantile(candidate, quantile, axis=axis) / np.quantile(reference, quantile, axis=axis)
    return 1.0 / ratio if higher_is_better else ratio


def compare_samples(
    reference: Sequence[float],
    candidate: Sequence[float],
    *,
    threshold: float,
    higher_is_better: bool,
    alpha: float = 0.05,
    paired: bool = False,
    quantile: float = 0.5,
    n_resamples: int = 2000,
    seed: int = 0,
) -> SpeedComparison:
    """Compare raw samples; see the module docstring for the decision rule.

    Raises:
        ValueError: too few samples, non-positive samples, or unequal lengths when paired.
    """
    ref = _as_samples("reference", reference)
    cand = _as_samples("candidate", candidate)
    if paired and ref.size != cand.size:
        raise ValueError(f"paired comparison needs equal sample counts, got {ref.size} and {cand.size}")
    if not 0.0 < alpha < 0.5 or threshold < 0 or not 0.0 < quantile < 1.0:
        raise ValueError(f"need 0 < alpha < 0.5, threshold >= 0, 0 < quantile < 1; got {alpha}, {threshold}, "
                         f"{quantile}")
    worse = "less" if higher_is_better else "greater"  # candidate worse than reference
    if paired:
        log_ratio = np.log(cand) - np.log(ref)  # (n,) per-pair, measured adjacently
        p_value = float(stats.wilcoxon(log_ratio, alternative=worse).pvalue) if np.any(log_ratio) else 1.0
    else:
        p_value = float(stats.mannwhitneyu(cand, ref, alternative=worse).pvalue)
    boot = stats.bootstrap(
        (ref, cand),
        lambda r, c, axis: quantile_slowdown(r, c, higher_is_better, quantile, axis=axis),
        n_resamples=n_resamples,
        paired=paired,
        vectorized=True,
        confidence_level=1.0 - 2.0 * alpha,  # each tail holds alpha: matches the one-sided test
        method="percentile",  # BCa is unstable with the ties of quantized timers
        rng=np.random.default_rng(seed),
    )
    slowdown = float(quantile_slowdown(ref, cand, higher_is_better, quantile))
    ci_low, ci_high = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
    significant = p_value < alpha and ci_low > 1.0
    limit = 1.0 + threshold  # tolerated slowdown
    numbers = (
        f"slowdown {slowdown:.4f} (regression {slowdown - 1:+.2%}, threshold {threshold:.0%}), "
        f"CI [{ci_low:.4f}, {ci_high:.4f}], p={p_value:.3g} (alpha {alpha})"
    )
    if slowdown > limit and significant:
        verdict, why = "fail", f"significant regression beyond threshold: {numbers}"
    elif slowdown <= limit and ci_high <= 1.0 + 2.0 * threshold:
        verdict, why = "pass", f"within threshold: {numbers}"
    else:
        verdict, why = "inconclusive", f"cannot decide: {numbers}"
    return SpeedComparison(
        verdict, slowdown, ci_low, ci_high, p_value, threshold, alpha, paired, ref.size, cand.size, 1, why
    )


def _interleaved(measure_reference: Measure, measure_candidate: Measure, n: int, start: int) -> tuple[list, list]:
    """n reference/candidate pairs measured adjacently in ABBA order (cancels linear drift)."""
    ref: list[float] = []
    cand: list[float] = []
    for i in range(start, start + n):
        if i % 2 == 0:
            ref.extend(measure_reference(1))
            cand.extend(measure_candidate(1))
        else:
            cand.extend(measure_candidate(1))
            ref.extend(measure_reference(1))
    return ref, cand


def sequential_speed_gate(
    measure_candidate: Measure,
    *,
    reference: Sequence[float] | None = None,
    measure_reference: Measure | None = None,
    samples: int,
    max_extra_rounds: int,
    threshold: float,
    higher_is_better: bool,
    alpha: float = 0.05,
    quantile: float = 0.5,
    seed: int = 0,
) -> tuple[SpeedComparison, list[float], list[float]]:
    """Measure, compare, and measure ``samples`` more per extra round while inconclusive.

    Unpaired mode compares live candidate samples with stored ``reference`` samples (the
    blessed baseline). Paired mode (``measure_reference`` given) measures the reference and the
    candidate interleaved in this session, so slow drifts of a shared machine hit both.

    Returns:
        (comparison, reference samples, candidate samples) — the raw samples for the report.
    """
    paired = measure_reference is not None
    if paired == (reference is not None):
        raise ValueError("give exactly one of reference (stored samples) or measure_reference (paired mode)")
    if samples < MIN_SAMPLES or max_extra_rounds < 0:
        raise ValueError(f"need samples >= {MIN_SAMPLES} and max_extra_rounds >= 0, got {samples}, {max_extra_rounds}")
    ref = list(reference) if reference is not None else []
    cand: list[float] = []
    rounds = 0
    while rounds <= max_extra_rounds:
        rounds += 1
        if measure_reference is not None:
            more_ref, more_cand = _interleaved(measure_reference, measure_candidate, samples, len(ref))
            ref += more_ref
            cand += more_cand
        else:
            cand += list(measure_candidate(samples))
        result = compare_samples(
            ref, cand, threshold=threshold, higher_is_better=higher_is_better, alpha=alpha, paired=paired,
            quantile=quantile, seed=seed,
        )
        if result.verdict != "inconclusive":
            break
    reason = result.reason + f" after {rounds} round(s) of {samples} samples"
    if result.verdict == "inconclusive":
        reason += f" (bound of {max_extra_rounds} extra rounds reached)"
    final = SpeedComparison(**{**asdict(result), "rounds": rounds, "reason": reason})
    return final, ref, cand


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    if p_value < alpha:
        verdict, why = "fail", f"significant drop beyond tolerance: {numbers}"
    elif mean < -tolerance:
        verdict, why = "pass", f"drop beyond tolerance but within noise (not significant): {numbers}"
    else:
        verdict, why = "pass", f"within tolerance: {numbers}"
    return PairedChange(verdict, change.size, n_changed, mean, ci_low, ci_high, p_value, tolerance, alpha, why)


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
