"""Speed statistics on synthetic samples (deterministic seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from distillgates.gates.stats import (
    Interval,
    compare_paired,
    compare_samples,
    mean_interval,
    sequential_speed_gate,
    wilson_interval,
)


def lognormal(seed: int, n: int, scale: float = 1.0, noise: float = 0.05) -> list[float]:
    return list(scale * np.random.default_rng(seed).lognormal(0.0, noise, n))


def test_same_distribution_passes():
    result = compare_samples(lognormal(1, 30), lognormal(2, 30), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass"
    assert 0.95 < result.slowdown < 1.05
    assert result.ci_low < 1.0 < result.ci_high


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_clear_regression_fails_in_both_orientations(higher_is_better):
    factor = 1 / 1.2 if higher_is_better else 1.2  # 20% slower: lower throughput or higher latency
    result = compare_samples(lognormal(1, 30), lognormal(2, 30, scale=factor), threshold=0.05,
                             higher_is_better=higher_is_better)
    assert result.verdict == "fail"
    assert result.slowdown == pytest.approx(1.2, rel=0.05)
    assert result.p_value < 0.01 and result.ci_low > 1.05


def test_improvement_passes():
    result = compare_samples(lognormal(1, 30), lognormal(2, 30, scale=0.8), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass" and result.slowdown < 0.9


def test_large_but_noisy_slowdown_is_inconclusive():
    # 8% slower on the median, but 40% noise and 6 samples: not significant, not within threshold.
    result = compare_samples(lognormal(3, 6, noise=0.4), lognormal(4, 6, scale=1.08, noise=0.4), threshold=0.05,
                             higher_is_better=False)
    assert result.verdict == "inconclusive", result.reason


def test_small_significant_regression_within_threshold_passes():
    result = compare_samples(lognormal(1, 200, noise=0.01), lognormal(2, 200, scale=1.02, noise=0.01),
                             threshold=0.05, higher_is_better=False)
    assert result.p_value < 0.05 and result.verdict == "pass"


def test_paired_mode_cancels_shared_drift():
    drift = np.linspace(1.0, 1.5, 40)  # the machine slows down during the session
    rng = np.random.default_rng(5)
    ref = drift * rng.lognormal(0, 0.01, 40)
    cand = drift * 1.10 * rng.lognormal(0, 0.01, 40)
    result = compare_samples(ref, cand, threshold=0.05, higher_is_better=False, paired=True)
    assert result.verdict == "fail" and result.slowdown == pytest.approx(1.10, rel=0.02)
    same = compare_samples(ref, drift * rng.lognormal(0, 0.01, 40), threshold=0.05, higher_is_better=False,
                           paired=True)
    assert same.verdict == "pass"


def test_p95_quantile_is_compared():
    ref = lognormal(1, 100)
    cand = sorted(lognormal(2, 100))
    cand[-10:] = [c * 1.5 for c in cand[-10:]]  # tail regression only
    assert compare_samples(ref, cand, threshold=0.05, higher_is_better=False).verdict == "pass"
    tail = compare_samples(ref, cand, threshold=0.05, higher_is_better=False, quantile=0.95)
    assert tail.slowdown > 1.3


@pytest.mark.parametrize(
    ("reference", "candidate", "kwargs", "message"),
    [
        ([1.0] * 3, [1.0] * 10, {}, "at least 5"),
        ([1.0] * 10, [1.0] * 9 + [float("nan")], {}, "finite"),
        ([1.0] * 10, [1.0] * 9 + [0.0], {}, "> 0"),
        ([1.0] * 10, [1.0] * 8, {"paired": True}, "equal sample counts"),
        ([1.0] * 10, [1.0] * 10, {"alpha": 0.7}, "alpha"),
    ],
)
def test_bad_input_raises(reference, candidate, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_samples(reference, candidate, threshold=0.05, higher_is_better=False, **kwargs)


def test_sequential_measures_more_while_inconclusive_and_stops_at_the_bound():
    spread = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # huge spread: 8% slower on the median, never significant
    calls = []

    def measure(n: int) -> list[float]:
        calls.append(n)
        return [1.08 * x for x in spread[:n]]

    result, ref, cand = sequential_speed_gate(measure, reference=spread, samples=6,
                                              max_extra_rounds=2, threshold=0.05, higher_is_better=False)
    assert calls == [6, 6, 6] and len(cand) == 18 and len(ref) == 6
    assert result.verdict == "inconclusive" and result.rounds == 3
    assert "bound of 2 extra rounds reached" in result.reason


def test_sequential_more_rounds_resolve_a_regression():
    rng = np.random.default_rng(1)
    result, _, cand = sequential_speed_gate(lambda n: list(1.15 * rng.lognormal(0, 0.15, n)),
                                            reference=lognormal(2, 60, noise=0.15), samples=5, max_extra_rounds=10,
                                            threshold=0.05, higher_is_better=False)
    assert result.verdict == "fail" and result.rounds > 1 and len(cand) == 5 * result.rounds


def test_sequential_paired_interleaves_abba():
    order: list[str] = []

    def ref(n: int) -> list[float]:
        order.append("R")
        return [1.0 + 0.01 * len(order)] * n

    def cand(n: int) -> list[float]:
        order.append("C")
        return [1.0 + 0.01 * len(order)] * n

    result, r, c = sequential_speed_gate(cand, measure_reference=ref, samples=6, max_extra_rounds=0,
                                         threshold=0.05, higher_is_better=False)
    assert "".join(order) == "RCCRRCCRRCCR" and len(r) == len(c) == 6 and result.paired


def test_sequential_needs_exactly_one_reference():
    with pytest.raises(ValueError, match="exactly one"):
        sequential_speed_gate(lambda n: [1.0] * n, samples=5, max_extra_rounds=0, threshold=0.05,
                              higher_is_better=False)


def test_estimate_under_threshold_with_wide_ci_is_inconclusive_not_pass():
    spread = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # same distribution, but a 10%+ regression is still plausible
    result = compare_samples(spread, spread, threshold=0.05, higher_is_better=False)
    assert result.slowdown == 1.0 and result.ci_high > 1.10
    assert result.verdict == "inconclusive"


# -- paired per-item drift test ---------------------------------------------------------------

BLESSED = {f"item-{i}": 1.0 if i % 5 else 0.5 for i in range(60)}


def test_paired_unchanged_items_pass_with_p_one():
    result = compare_paired(BLESSED, dict(BLESSED), tolerance=0.01)
    assert result.verdict == "pass" and result.p_value == 1.0 and result.n == 60 and result.n_changed == 0


def test_paired_single_item_drop_beyond_tolerance_is_noise():
    current = {**BLESSED, "item-1": 0.0}  # mean change -1/60 = -0.0167 < -0.01, but one item
    result = compare_paired(BLESSED, current, tolerance=0.01)
    assert result.mean_change == pytest.approx(-1 / 60)
    assert result.verdict == "pass" and result.p_value > 0.05 and "not significant" in result.reason


def test_paired_broad_drop_fails_with_the_numbers():
    current = {k: (0.0 if i < 12 else v) for i, (k, v) in enumerate(BLESSED.items())}  # 20% of the items lose F1
    result = compare_paired(BLESSED, current, tolerance=0.01)
    assert result.verdict == "fail" and result.p_value < 0.05 and result.ci_high < -0.01
    assert result.ci_low <= result.mean_change <= result.ci_high
    assert ("n=60 items (12 changed), mean change -0.1750, 90% CI [-0.2540, -0.0960], p=0.00046 (one-sided paired "
            "t-test of mean change >= -0.01, alpha 0.05)") in result.reason


def test_paired_drop_within_tolerance_passes_however_many_items_show_it():
    current = {k: v - 0.005 for k, v in BLESSED.items()}  # every item a little worse: certain, but within 0.01
    result = compare_paired(BLESSED, current, tolerance=0.01)
    assert result.verdict == "pass" and result.p_value == 1.0 and "within tolerance" in result.reason


def test_paired_tests_the_drop_beyond_the_tolerance_not_any_drop():
    """Six of 60 items lose 0.15: a drop of 0.015 on average, clearly a drop, but not clearly beyond 0.01."""
    current = {k: v - (0.15 if i % 5 and i < 8 else 0.0) for i, (k, v) in enumerate(BLESSED.items())}
    result = compare_paired(BLESSED, current, tolerance=0.01)
    assert result.mean_change == pytest.approx(-0.015) and result.ci_high < 0  # a drop, for sure
    assert result.verdict == "pass" and result.p_value > 0.05  # ... beyond the tolerance, not for sure


def test_paired_small_slice_fails_when_most_items_drop():
    """Four items (the toy's 128-token slice): one lost item is noise, three of four fail; no spread is exact."""
    blessed = {str(i): 1.0 for i in range(4)}
    assert compare_paired(blessed, {**blessed, "0": 0.0}, tolerance=0.01).verdict == "pass"
    assert compare_paired(blessed, {**blessed, "0": 0.0, "1": 0.0, "2": 0.0}, tolerance=0.01).verdict == "fail"
    every = compare_paired(blessed, dict.fromkeys(blessed, 0.5), tolerance=0.01)
    assert every.verdict == "fail" and every.p_value == 0.0 and every.ci_low == every.ci_high == -0.5
    assert compare_paired({"a": 1.0}, {"a": 0.0}, tolerance=0.01).verdict == "pass"  # one item: nothing to infer


def test_paired_gain_passes():
    current = {k: 1.0 for k in BLESSED}
    assert compare_paired(BLESSED, current, tolerance=0.01).mean_change > 0


@pytest.mark.parametrize(("blessed", "current", "kwargs", "message"), [
    ({"a": 1.0}, {"b": 1.0}, {}, r"1 blessed items not in the run \['a'\], 1 run items not blessed \['b'\]"),
    ({}, {}, {}, "no per-item scores"),
    ({"a": 1.0}, {"a": float("nan")}, {}, "finite"),
    ({"a": 1.0}, {"a": 1.0}, {"alpha": 0.7}, "alpha"),
])
def test_paired_bad_input_raises(blessed, current, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_paired(blessed, current, tolerance=kwargs.pop("tolerance", 0.01), **kwargs)


# -- n and confidence intervals of quality figures ----------------------------------------------


def test_wilson_interval_brackets_the_rate_and_stays_in_unit_range():
    interval = wilson_interval(198, 200)
    assert interval is not None and interval.n == 200
    assert interval.low == pytest.approx(0.9643, abs=1e-4) and interval.high == pytest.approx(0.9973, abs=1e-4)
    perfect = wilson_interval(200, 200)
    assert perfect is not None and perfect.high == 1.0 and perfect.low == pytest.approx(0.9812, abs=1e-4)
    assert wilson_interval(0, 0) is None  # an undefined rate has no interval


def test_mean_interval_is_a_t_interval():
    interval = mean_interval([0.0, 1.0, 1.0, 1.0])  # mean 0.75, sd 0.5, t(0.975, 3) = 3.182
    assert interval is not None and interval.n == 4
    assert interval.low == pytest.approx(0.75 - 3.1824 * 0.25, abs=1e-3)
    assert interval.high == pytest.approx(0.75 + 3.1824 * 0.25, abs=1e-3)
    assert mean_interval([0.5]) == Interval(1, 0.5, 0.5) and mean_interval([]) is None
