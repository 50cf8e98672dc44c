"""Gate statistics on synthetic samples (deterministic seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from distillgates.gates.stats import (
    Interval,
    compare_paired,
    compare_quantiles,
    mean_interval,
    sequential_speed_gate,
    session_test_alpha,
    wilson_interval,
)


def lognormal(seed: int, n: int, scale: float = 1.0, noise: float = 0.05) -> list[float]:
    return list(scale * np.random.default_rng(seed).lognormal(0.0, noise, n))


def blocks(samples: list[float], width: int = 8) -> list[list[float]]:
    return [samples[i : i + width] for i in range(0, len(samples), width)]


def test_same_distribution_passes():
    result = compare_quantiles(lognormal(1, 64), lognormal(2, 64), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass"
    assert 0.95 < result.slowdown < 1.05
    assert result.ci_low < 1.0 < result.ci_high


@pytest.mark.parametrize("higher_is_better", [False, True])
def test_clear_regression_fails_in_both_orientations(higher_is_better):
    factor = 1 / 1.2 if higher_is_better else 1.2  # 20% slower: lower throughput or higher latency
    result = compare_quantiles(lognormal(1, 64), lognormal(2, 64, scale=factor), threshold=0.05,
                               higher_is_better=higher_is_better, test_alpha=0.05 / 16)
    assert result.verdict == "fail"
    assert result.slowdown == pytest.approx(1.2, rel=0.05)
    assert result.ci_low > 1.05


def test_improvement_passes():
    result = compare_quantiles(lognormal(1, 64), lognormal(2, 64, scale=0.8), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass" and result.slowdown < 0.9


def test_slowdown_beyond_threshold_that_noise_cannot_confirm_is_inconclusive():
    # 8% slower on the median, 40% noise, 6 samples: beyond the threshold, not significant
    result = compare_quantiles(lognormal(3, 6, noise=0.4), lognormal(4, 6, scale=1.08, noise=0.4), threshold=0.05,
                               higher_is_better=False)
    assert result.slowdown > 1.05 and result.ci_low <= 1.0
    assert result.verdict == "inconclusive", result.reason


def test_significant_regression_within_threshold_passes():
    result = compare_quantiles(lognormal(1, 400, noise=0.01), lognormal(2, 400, scale=1.02, noise=0.01),
                               threshold=0.05, higher_is_better=False)
    assert result.ci_low > 1.0 and result.verdict == "pass"


def test_each_quantile_gate_sees_only_its_statistic():
    """A regression only in the slow tail: the p50 gate passes, the p95 gate fails (and for a rate, p5)."""
    ref = lognormal(1, 400, noise=0.02)
    cand = sorted(lognormal(2, 400, noise=0.02))
    cand[-40:] = [c * 1.5 for c in cand[-40:]]  # the slowest 10% of the candidate's requests are 50% slower
    assert compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False).verdict == "pass"
    tail = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, quantile=0.95, test_alpha=0.05 / 16)
    assert tail.verdict == "fail" and tail.slowdown > 1.3
    rates = [1000 / c for c in cand]  # the same requests as throughput: the slow tail is the low quantile
    low = compare_quantiles([1000 / r for r in ref], rates, threshold=0.05, higher_is_better=True, quantile=0.05)
    assert low.verdict == "fail"
    assert compare_quantiles([1000 / r for r in ref], rates, threshold=0.05, higher_is_better=True,
                             quantile=0.95).verdict == "pass"


def test_paired_blocks_cancel_shared_drift_that_unpaired_samples_cannot():
    """Interleaved A/B: the machine slows down by half during the session, both arms alike. Resampling the
    blocks in pairs keeps the drift out of the interval; resampling the samples alone does not."""
    rng = np.random.default_rng(5)
    drift = np.repeat(np.linspace(1.0, 1.5, 16), 8)  # (128,) one level per block of 8
    ref = drift * rng.lognormal(0, 0.01, 128)
    cand = drift * 1.10 * rng.lognormal(0, 0.01, 128)
    paired = compare_quantiles(blocks(list(ref)), blocks(list(cand)), threshold=0.05, higher_is_better=False,
                               paired_blocks=True, test_alpha=0.05 / 16)
    assert paired.verdict == "fail" and paired.slowdown == pytest.approx(1.10, rel=0.03)
    unpaired = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, test_alpha=0.05 / 16)
    assert unpaired.ci_high - unpaired.ci_low > 2 * (paired.ci_high - paired.ci_low)
    same = compare_quantiles(blocks(list(ref)), blocks(list(drift * rng.lognormal(0, 0.01, 128))), threshold=0.05,
                             higher_is_better=False, paired_blocks=True)
    assert same.verdict == "pass"


def test_paired_blocks_allow_blocks_missing_samples():
    ref = blocks(lognormal(1, 64))
    cand = blocks(lognormal(2, 64, scale=1.3))
    cand[0] = cand[0][:5]  # a block with fewer TPS samples (a generation of one token has none)
    result = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, paired_blocks=True)
    assert result.verdict == "fail" and result.n_candidate == 61


@pytest.mark.parametrize(
    ("reference", "candidate", "kwargs", "message"),
    [
        ([1.0] * 3, [1.0] * 10, {}, "at least 5"),
        ([1.0] * 10, [1.0] * 9 + [float("nan")], {}, "finite"),
        ([1.0] * 10, [1.0] * 9 + [0.0], {}, "> 0"),
        ([[1.0] * 8] * 2, [[1.0] * 8] * 3, {"paired_blocks": True}, "2 reference and 3 candidate blocks"),
        ([1.0] * 10, [1.0] * 10, {"test_alpha": 0.7}, "test_alpha"),
        ([1.0] * 10, [1.0] * 10, {"quantile": 1.0}, "quantile"),
    ],
)
def test_bad_input_raises(reference, candidate, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_quantiles(reference, candidate, threshold=0.05, higher_is_better=False, **kwargs)


def test_session_alpha_is_split_over_gates_and_looks():
    assert session_test_alpha(0.05, 4, 4) == pytest.approx(0.05 / 16)
    with pytest.raises(ValueError, match="looks"):
        session_test_alpha(0.05, 4, 0)


def test_sequential_looks_until_decided_and_stops_at_the_bound():
    spread = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # 8% slower on the median, never significant with this spread
    asked = []

    def samples_after(k: int):
        asked.append(k)
        return spread * k, [1.08 * x for x in spread] * k

    result = sequential_speed_gate(samples_after, looks=3, threshold=0.05, higher_is_better=False, n_gates=4)
    assert asked == [1, 2, 3]
    assert result.verdict == "inconclusive" and result.rounds == 3
    assert result.test_alpha == pytest.approx(0.05 / 12)
    assert "look 3 of at most 3" in result.reason and "the bound of rounds is reached" in result.reason


def test_sequential_more_rounds_resolve_a_regression():
    rng = np.random.default_rng(1)
    ref, cand = list(rng.lognormal(0, 0.15, 200)), list(1.15 * rng.lognormal(0, 0.15, 200))
    result = sequential_speed_gate(lambda k: (ref[: 10 * k], cand[: 10 * k]), looks=10, threshold=0.05,
                                   higher_is_better=False, n_gates=4)
    assert result.verdict == "fail" and result.rounds > 1 and result.n_candidate == 10 * result.rounds


def test_sequential_stops_at_the_first_decision():
    asked = []

    def samples_after(k: int):
        asked.append(k)
        return lognormal(1, 64), lognormal(2, 64)

    assert sequential_speed_gate(samples_after, looks=4, threshold=0.05, higher_is_better=False).verdict == "pass"
    assert asked == [1]


def test_a_a_estimates_beyond_the_threshold_do_not_fail_without_significance():
    """No change, heavy noise, 4 gates x 4 looks in 20 simulated sessions: many estimates land beyond the 5%
    threshold by chance, none fails (a fail needs the estimate beyond the threshold *and* significance at the
    session's alpha split over gates and looks)."""
    verdicts = []
    for session in range(20):
        rng = np.random.default_rng(session)
        ref, cand = rng.lognormal(0, 0.3, 128), rng.lognormal(0, 0.3, 128)
        verdicts += [
            sequential_speed_gate(lambda k, ref=ref, cand=cand: (ref[: 32 * k], cand[: 32 * k]), looks=4,
                                  threshold=0.05, higher_is_better=hib, quantile=q, n_gates=4).verdict
            for q, hib in ((0.5, False), (0.95, False), (0.5, True), (0.05, True))
        ]
    assert verdicts.count("fail") == 0
    assert verdicts.count("inconclusive") >= 5  # the estimate was beyond the threshold through all 4 looks


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
