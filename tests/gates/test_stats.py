"""Gate statistics on synthetic samples (deterministic seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from distillgates.gates.stats import (
    Interval,
    compare_paired,
    compare_quantiles,
    compare_speedup,
    corrected_ratio,
    mean_interval,
    sequential_speed_gate,
    session_test_alpha,
    wilson_interval,
)


def processes(seed: int, k: int = 8, n: int = 24, scale: float = 1.0, noise: float = 0.05,
              offset: float = 0.0) -> list[list[float]]:
    """``k`` worker processes of ``n`` log-normal samples; each process has its own lasting speed offset (a
    log-normal factor of sigma ``offset``), as real worker processes do."""
    rng = np.random.default_rng(seed)
    return [list(scale * rng.lognormal(0.0, offset) * rng.lognormal(0.0, noise, n)) for _ in range(k)]


def test_same_distribution_passes():
    result = compare_quantiles(processes(1), processes(2), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass"
    assert result.ci_low < 1.0 < result.ci_high
    assert result.groups_reference == result.groups_candidate == 8 and result.n_candidate == 8 * 24


@pytest.mark.parametrize("higher_is_better", [False, True])
@pytest.mark.parametrize("paired", [True, False])
def test_clear_regression_fails_in_both_orientations_and_modes(higher_is_better, paired):
    factor = 0.8 if higher_is_better else 1.25  # 20-25% worse either way
    result = compare_quantiles(processes(1), processes(2, scale=factor), threshold=0.05,
                               higher_is_better=higher_is_better, paired=paired)
    assert result.verdict == "fail", result.reason
    assert result.slowdown == pytest.approx(1.25, rel=0.05)
    assert result.ci_low > 1.0 and "significant regression beyond threshold" in result.reason
    assert ("process pairs" if paired else "Welch") in result.reason


def test_improvement_passes():
    result = compare_quantiles(processes(1), processes(2, scale=0.8), threshold=0.05, higher_is_better=False)
    assert result.verdict == "pass" and result.slowdown < 1.0


def test_slowdown_beyond_threshold_that_noise_cannot_confirm_is_inconclusive():
    ref = processes(3, k=3, noise=0.01)  # candidate processes 10% faster, 30% slower, 5% slower: +7% overall
    cand = [[f * x for x in group] for f, group in zip((0.9, 1.3, 1.05), processes(4, k=3, noise=0.01))]
    result = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, test_alpha=0.05 / 16)
    assert result.verdict == "inconclusive" and "not significant" in result.reason


def test_significant_regression_within_threshold_passes():
    result = compare_quantiles(processes(1, noise=0.005), processes(2, scale=1.02, noise=0.005), threshold=0.05,
                               higher_is_better=False)
    assert result.verdict == "pass" and result.ci_low > 1.0


def test_each_quantile_gate_sees_only_its_statistic():
    """A regression of the slow tail only (every 10th sample 50% slower) fails p95, not the median; for a
    rate the slow tail is the low quantile."""
    ref = processes(5, k=8, n=40, noise=0.01)
    cand = [[x * (1.5 if i % 10 == 9 else 1.0) for i, x in enumerate(group)] for group in processes(6, k=8, n=40,
                                                                                                    noise=0.01)]
    assert compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False).verdict == "pass"
    tail = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, quantile=0.95, test_alpha=0.05 / 16)
    assert tail.verdict == "fail" and tail.quantile == 0.95
    rates = [[1000 / x for x in group] for group in cand]
    ref_rates = [[1000 / x for x in group] for group in ref]
    assert compare_quantiles(ref_rates, rates, threshold=0.05, higher_is_better=True, quantile=0.05).verdict == "fail"
    assert compare_quantiles(ref_rates, rates, threshold=0.05, higher_is_better=True, quantile=0.5).verdict == "pass"


def test_pairs_cancel_drift_shared_by_the_two_processes_of_a_pair():
    """The machine drifts by up to 30% between pairs: per-pair ratios cancel it (paired), the Welch test of
    unpaired processes sees it as noise and cannot confirm a 10% regression."""
    rng = np.random.default_rng(7)
    drift = rng.uniform(0.7, 1.3, 8)
    ref = [list(d * rng.lognormal(0, 0.01, 24)) for d in drift]
    cand = [list(1.10 * d * rng.lognormal(0, 0.01, 24)) for d in drift]
    paired = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, test_alpha=0.05 / 16)
    unpaired = compare_quantiles(ref, cand, threshold=0.05, higher_is_better=False, test_alpha=0.05 / 16,
                                 paired=False)
    assert paired.verdict == "fail" and paired.slowdown == pytest.approx(1.10, rel=0.01)
    assert unpaired.verdict != "fail"


def test_an_interval_over_samples_alone_would_read_process_offsets_as_regressions():
    """The reason the process is the unit: with a lasting per-process offset (sigma 5%, as measured for TPS on
    the CI VM) and no change at all, simulated sessions of 4 gates x 4 looks fail at most at the session's
    alpha; a test that pools the samples of one process per arm (as if they were independent) fails often."""
    from scipy import stats

    fails, pooled_fails = 0, 0
    for session in range(200):
        ref, cand = processes(2 * session, k=24, offset=0.05), processes(2 * session + 1, k=24, offset=0.05)
        verdicts = [sequential_speed_gate(lambda k, ref=ref, cand=cand: (ref[: 6 * k], cand[: 6 * k]), looks=4,
                                          threshold=0.05, higher_is_better=hib, quantile=q, n_gates=4).verdict
                    for q, hib in ((0.5, False), (0.95, False), (0.5, True), (0.05, True))]
        fails += "fail" in verdicts
        one_ref, one_cand = np.log(ref[0]), np.log(cand[0])  # one process per arm, samples as the unit
        pooled = stats.ttest_ind(one_cand, one_ref, alternative="greater")
        pooled_fails += bool(pooled.pvalue < 0.05 / 16 and np.exp(one_cand.mean() - one_ref.mean()) > 1.05)
    assert fails <= 0.05 * 200  # at most alpha
    assert pooled_fails >= 20


@pytest.mark.parametrize(
    ("reference", "candidate", "kwargs", "message"),
    [
        ([[1.0] * 3] * 2, [[1.0] * 10] * 2, {}, "reference process 0: need a flat list of at least 5"),
        ([[1.0] * 10] * 2, [[1.0] * 9 + [float("nan")]] * 2, {}, "finite"),
        ([[1.0] * 10] * 2, [[1.0] * 9 + [0.0]] * 2, {}, "> 0"),
        ([[1.0] * 10], [[1.0] * 10] * 2, {}, "at least 2 worker processes, got 1"),
        ([[1.0] * 8] * 2, [[1.0] * 8] * 3, {}, "2 reference and 3 candidate processes"),
        ([[1.0] * 10] * 2, [[1.0] * 10] * 2, {"test_alpha": 0.7}, "test_alpha"),
        ([[1.0] * 10] * 2, [[1.0] * 10] * 2, {"quantile": 1.0}, "quantile"),
    ],
)
def test_bad_input_raises(reference, candidate, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare_quantiles(reference, candidate, threshold=0.05, higher_is_better=False, **kwargs)


def test_without_spread_the_change_is_exact():
    same = compare_quantiles([[1.0] * 8] * 3, [[1.0] * 8] * 3, threshold=0.05, higher_is_better=False)
    slower = compare_quantiles([[1.0] * 8] * 3, [[1.2] * 8] * 3, threshold=0.05, higher_is_better=False)
    assert same.verdict == "pass" and same.p_value == 1.0
    assert slower.verdict == "fail" and slower.p_value == 0.0 and slower.ci_low == pytest.approx(1.2)


def test_session_alpha_is_split_over_gates_and_looks():
    assert session_test_alpha(0.05, 4, 4) == pytest.approx(0.05 / 16)
    with pytest.raises(ValueError, match="looks"):
        session_test_alpha(0.05, 4, 0)


def test_sequential_looks_until_decided_and_stops_at_the_bound():
    asked = []

    def samples_after(k: int):  # 8% slower, processes spread too widely to confirm it
        asked.append(k)
        return processes(1, k=2 * k, offset=0.3), processes(2, k=2 * k, scale=1.08, offset=0.3)

    result = sequential_speed_gate(samples_after, looks=3, threshold=0.05, higher_is_better=False, n_gates=4)
    assert asked == [1, 2, 3]
    assert result.verdict == "inconclusive" and result.rounds == 3
    assert result.test_alpha == pytest.approx(0.05 / 12)
    assert "look 3 of at most 3" in result.reason and "the bound of rounds is reached" in result.reason


def test_sequential_more_rounds_resolve_a_regression():
    ref, cand = processes(1, k=40, offset=0.05), processes(2, k=40, scale=1.15, offset=0.05)
    result = sequential_speed_gate(lambda k: (ref[: 3 * k], cand[: 3 * k]), looks=10, threshold=0.05,
                                   higher_is_better=False, n_gates=4)
    assert result.verdict == "fail" and result.rounds > 1 and result.groups_candidate == 3 * result.rounds


def test_sequential_stops_at_the_first_decision():
    asked = []

    def samples_after(k: int):
        asked.append(k)
        return processes(1), processes(2)

    assert sequential_speed_gate(samples_after, looks=4, threshold=0.05, higher_is_better=False).verdict == "pass"
    assert asked == [1]


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


def test_a_corrected_ratio_is_the_cheap_ratio_where_the_sample_agrees_and_the_costly_one_over_every_item():
    y, x = [1.0] * 196 + [0.0] * 4, [1.0] * 200  # 196 of 200 (the eval's figure, PyTorch)
    base = wilson_interval(196, 200)
    assert corrected_ratio(y, x, [0.0] * 29, [0.0] * 29, base) == (0.98, base)  # the sample decodes as PyTorch
    # the sample is every item: the costly ratio itself, 190 of 200 (here with 2 more calls it emitted)
    dy, dx = [-1.0] * 6 + [0.0] * 194, [0.0] * 198 + [1.0, 1.0]
    estimate, interval = corrected_ratio(y, x, dy, dx, base)
    assert estimate == pytest.approx(190 / 202) and interval is not None and interval.n == 200
    assert interval.low < estimate < interval.high <= 1.0
    assert corrected_ratio([], [], [], [], None) == (None, None)  # nothing measured: no figure
    assert corrected_ratio([1.0], [1.0], [0.0], [0.0], wilson_interval(1, 1))[1] is None  # one item: no spread


def test_a_corrected_ratio_estimates_the_costly_ratio_without_bias():
    """A population of 200 items (1-2 calls, 97% hits) where the costly measurement loses a hit on one item in ten:
    over 4000 random samples of 32 the estimate averages to the costly ratio (not the cheap one) and its interval
    covers it about as often as its level says."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, 3, 200).astype(float)
    y = rng.binomial(x.astype(int), 0.97).astype(float)
    costly = np.where(rng.random(200) < 0.1, np.maximum(y - 1, 0), y)
    truth, base = costly.sum() / x.sum(), wilson_interval(int(y.sum()), int(x.sum()))
    estimates, covered = [], 0
    for _ in range(4000):
        idx = rng.choice(200, 32, replace=False)
        estimate, interval = corrected_ratio(y, x, costly[idx] - y[idx], np.zeros(32), base)
        estimates.append(estimate)
        covered += interval is not None and interval.low <= truth <= interval.high
    assert y.sum() / x.sum() - truth > 0.04  # the two differ
    assert float(np.mean(estimates)) == pytest.approx(truth, abs=0.002)
    assert 0.90 <= covered / 4000 <= 0.99


def test_detectable_drop_and_underpowered_slices():
    from distillgates.gates.stats import POWER_FACTOR, compare_paired, detectable_drop, items_for_tolerance

    assert detectable_drop([1.0], [0.0], tolerance=0.01, alpha=0.05) == (float("inf"), 0.0)  # one item never fails
    four = {str(i): 1.0 for i in range(4)}
    two_lost = compare_paired(four, {**four, "0": 0.0, "1": 0.0}, tolerance=0.01, alpha=0.05)
    assert two_lost.verdict == "pass" and round(two_lost.p_value, 3) == 0.094 and two_lost.underpowered
    assert two_lost.detectable_drop > POWER_FACTOR * 0.01 and "UNDERPOWERED" in two_lost.reason
    n = items_for_tolerance(0.2, 0.01)
    spread_02 = [0.0, 0.4] * (n // 2) + [0.2] * (n % 2)  # population SD 0.2: sample SD just above it
    assert detectable_drop([0.2] * (n - 1), [0.0] * (n - 1), tolerance=0.01, alpha=0.05)[0] <= 0.03  # floor only
    assert detectable_drop(spread_02[:n - 40], [0.0] * (n - 40), tolerance=0.01, alpha=0.05)[0] > 0.03
    assert n == 273


# -- a claimed gain (speculative speedup): shown, shown short, or undecided ------------------------------


def both_modes(seed: int, gain: float, k: int = 6, offset: float = 0.07, noise: float = 0.03):
    """``k`` processes, each measuring both modes: a lasting offset per process shared by its two modes."""
    rng = np.random.default_rng(seed)
    plain, treated = [], []
    for _ in range(k):
        factor = rng.lognormal(0.0, offset)
        plain.append(list(100.0 * factor * rng.lognormal(0.0, noise, 16)))
        treated.append(list(100.0 * gain * factor * rng.lognormal(0.0, noise, 16)))
    return plain, treated


def test_a_clear_speedup_is_shown_and_a_clear_slowdown_fails():
    shown = compare_speedup(*both_modes(1, 1.3), minimum=1.0)
    assert shown.verdict == "pass" and shown.ci_low >= 1.0 and shown.speedup == pytest.approx(1.3, rel=0.05)
    short = compare_speedup(*both_modes(2, 0.35), minimum=1.0)  # 135M: re-measured 0.31-0.39
    assert short.verdict == "fail" and short.ci_high < 1.0 and "below the minimum" in short.reason


def test_a_speedup_short_of_a_minimum_above_one_fails():
    result = compare_speedup(*both_modes(3, 1.1, noise=0.005), minimum=1.5)
    assert result.verdict == "fail" and 1.0 < result.ci_high < 1.5


def test_a_speedup_the_processes_cannot_tell_is_inconclusive():
    plain, _ = both_modes(4, 1.0)
    treated = [[x * (1.05 if k % 2 else 0.96) for x in group] for k, group in enumerate(plain)]
    result = compare_speedup(plain, treated, minimum=1.0)
    assert result.verdict == "inconclusive" and result.ci_low < 1.0 < result.ci_high
    assert "cannot tell" in result.reason


def test_the_process_offset_cancels_within_a_process():
    """Offsets of 30% between processes would swamp a 10% gain between processes; within each it cancels."""
    result = compare_speedup(*both_modes(5, 1.1, offset=0.3, noise=0.01), minimum=1.0)
    assert result.verdict == "pass" and result.speedup == pytest.approx(1.1, rel=0.02)


@pytest.mark.parametrize(("baseline", "treated", "message"), [
    ([[100.0] * 16], [[150.0] * 16], "at least 2 worker processes"),  # one timing pair decides nothing
    ([[100.0] * 16] * 3, [[150.0] * 16] * 2, "each process measures both arms"),
    ([[100.0] * 3] * 3, [[150.0] * 3] * 3, "at least 5 samples"),
])
def test_speedup_bad_input_raises(baseline, treated, message):
    with pytest.raises(ValueError, match=message):
        compare_speedup(baseline, treated, minimum=1.0)
