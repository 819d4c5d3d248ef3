"""conformance.checks.stats: pooling, the statistics, impossible draws, the level and power."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.checks.stats import (
    ALPHA,
    CR_LAMBDA,
    METHODS,
    NOMINAL_ALPHA,
    bonferroni,
    gof_test,
    pool_cells,
    power,
)


def test_pooling_merges_smallest_and_keeps_zeros_apart() -> None:
    pooling = pool_cells([100.0, 3.0, 0.0, 4.0, 50.0, 2.0], min_expected=9.0)
    assert pooling.impossible == (2,)
    assert pooling.groups == ((0,), (1, 3, 5), (4,))
    assert pooling.df == 2
    stricter = pool_cells([100.0, 3.0, 0.0, 4.0, 50.0, 2.0], min_expected=10.0)
    assert stricter.groups == ((0,), (1, 3, 4, 5))  # 2+3+4 = 9 is still short: takes the 50
    alone = pool_cells([1.0, 2.0], min_expected=10.0)
    assert alone.groups == ((0, 1),) and alone.df == 0


def test_null_samples_are_not_rejected() -> None:
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(16))
    for _ in range(20):
        for method in ("cr", "g", "pearson"):
            result = gof_test(rng.multinomial(5000, p), p, method=method)
            assert not result.rejected, result.summary()
    uniform = np.full(64, 1 / 64)
    assert not gof_test(rng.multinomial(2000, uniform), uniform).rejected


def test_different_distribution_is_rejected() -> None:
    rng = np.random.default_rng(2)
    p = np.full(16, 1 / 16)
    q = p.copy()
    q[0], q[1] = 2 / 16, 0.0
    result = gof_test(rng.multinomial(5000, q), p)
    assert result.rejected and result.p_value < 1e-12, result.summary()


def test_statistics_by_hand() -> None:
    counts, p = np.array([30.0, 50.0, 20.0]), np.array([0.25, 0.5, 0.25])
    e = 100 * p
    g = 2 * float((counts * np.log(counts / e)).sum())
    x2 = float(((counts - e) ** 2 / e).sum())
    lam = CR_LAMBDA
    cr = 2 / (lam * (lam + 1)) * float((counts * ((counts / e) ** lam - 1)).sum())
    assert gof_test(counts, p, method="g").statistic == pytest.approx(g)
    assert gof_test(counts, p, method="pearson").statistic == pytest.approx(x2)
    result = gof_test(counts, p)
    assert result.method == "cr" and result.statistic == pytest.approx(cr)
    assert result.alpha == NOMINAL_ALPHA == ALPHA / 2
    assert result.df == 2 and result.p_value == pytest.approx(math.exp(-cr / 2), rel=1e-12)


def by_hand(counts: np.ndarray, e: np.ndarray, method: str) -> float:
    """The three statistics from their textbook formulas, for comparison with scipy's."""
    if method == "g":
        return 2 * float((counts * np.log(counts / e)).sum())
    if method == "pearson":
        return float(((counts - e) ** 2 / e).sum())
    lam = CR_LAMBDA
    return 2 / (lam * (lam + 1)) * float((counts * ((counts / e) ** lam - 1)).sum())


@pytest.mark.parametrize("method", METHODS)
def test_statistic_is_taken_over_pooled_cells(method: str) -> None:
    """Expected 5 + 5 is merged into one cell: the statistic and df see four cells."""
    counts, p = np.array([41, 33, 14, 9, 3]), np.array([0.5, 0.3, 0.1, 0.05, 0.05])
    result = gof_test(counts, p, method=method)
    pooled = np.array([41.0, 33.0, 14.0, 12.0])
    assert (result.cells, result.df) == (4, 3)
    assert result.statistic == pytest.approx(by_hand(pooled, 100 * np.array([0.5, 0.3, 0.1, 0.1]),
                                                     method), rel=1e-12)
    x = result.statistic  # chi-square survival for df 3, closed form
    want = math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    assert result.p_value == pytest.approx(want, rel=1e-10)


def test_draw_of_probability_zero_rejects_outright() -> None:
    p = np.array([0.5, 0.5, 0.0])
    result = gof_test([500, 499, 1], p)
    assert result.impossible_hits == 1 and result.p_value == 0.0 and result.rejected


@pytest.mark.parametrize("method", METHODS)
def test_statistic_with_impossible_draws_covers_the_possible_ones(method: str) -> None:
    """With impossible draws the statistic still describes the rest of the table: the possible
    draws against the null scaled to their number (never negative, unlike expected counts
    that sum to more than the draws)."""
    p = np.array([0.5, 0.5, 0.0])
    result = gof_test([520, 470, 10], p, method=method)
    want = by_hand(np.array([520.0, 470.0]), np.array([495.0, 495.0]), method)
    assert result.statistic == pytest.approx(want, rel=1e-12) and result.statistic > 0
    assert result.impossible_hits == 10 and result.p_value == 0.0
    only_impossible = gof_test([0, 0, 100], p, method=method)
    assert only_impossible.df == 1 and only_impossible.statistic == 0.0
    assert only_impossible.rejected


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="probs"):
        gof_test([1, 2], [0.5, 0.6])
    with pytest.raises(ValueError, match="counts"):
        gof_test([1, 2, 3], [0.5, 0.5])
    with pytest.raises(ValueError, match="counts"):
        gof_test([0, 0], [0.5, 0.5])
    with pytest.raises(ValueError, match="method"):
        gof_test([5, 5], [0.5, 0.5], method="ks")
    with pytest.raises(ValueError, match="method"):
        power([0.5, 0.5], [0.5, 0.5], 100, method="ks")
    with pytest.raises(ValueError, match="alpha"):
        power([0.5, 0.5], [0.5, 0.5], 100, alpha=0.0)
    with pytest.raises(ValueError, match="p_alt"):
        power([0.5, 0.5], [0.2, 0.3, 0.5], 100)


@pytest.mark.parametrize(("alpha", "trials"), [(1e-2, 20_000), (1e-3, 100_000)])
def test_false_alarm_rate_is_calibrated(alpha: float, trials: int) -> None:
    """Under the null the rejection rate matches alpha where Monte Carlo can see it (expected
    200 and 100 rejections, +- 4 standard deviations; pooled small cells included)."""
    p = np.random.default_rng(3).dirichlet(np.ones(24) * 0.7)
    rate = power(p, p, 1500, alpha=alpha, trials=trials, rng=np.random.default_rng(4))
    expected = alpha * trials
    assert abs(rate * trials - expected) < 4 * expected**0.5, rate


@pytest.mark.parametrize("method", METHODS)
def test_power_agrees_with_gof_test_sample_by_sample(method: str) -> None:
    """``power``'s vectorised path (all samples at once, a critical value instead of p-values,
    samples with impossible draws set aside) rejects exactly the samples ``gof_test`` rejects."""
    p_null = np.array([0.3, 0.25, 0.2, 0.15, 0.06, 0.03, 0.01, 0.0])
    p_alt = np.array([0.28, 0.26, 0.21, 0.15, 0.06, 0.03, 0.008, 0.002])
    n, trials, alpha = 400, 400, 0.05
    rate = power(p_null, p_alt, n, alpha=alpha, trials=trials, rng=np.random.default_rng(7),
                 method=method)
    samples = np.random.default_rng(7).multinomial(n, p_alt, size=trials)
    results = [gof_test(c, p_null, alpha=alpha, method=method) for c in samples]
    with_hits = sum(r.impossible_hits > 0 for r in results)
    assert 0 < with_hits < trials  # both paths are exercised
    assert any(r.rejected and not r.impossible_hits for r in results)
    assert any(not r.rejected for r in results)
    assert rate == sum(r.rejected for r in results) / trials


def test_power_grows_with_sample_size() -> None:
    p = np.full(8, 1 / 8)
    q = p + np.array([0.02, -0.02, 0, 0, 0, 0, 0, 0])
    small = power(p, q, 500, trials=500, rng=np.random.default_rng(5))
    large = power(p, q, 50_000, trials=500, rng=np.random.default_rng(5))
    assert small < 0.1 and large > 0.99
    support = power([0.5, 0.5, 0.0], [0.49, 0.5, 0.01], 2000, trials=200)
    assert support == 1.0  # any draw outside the null's support rejects


def test_bonferroni_splits_the_budget() -> None:
    assert bonferroni(ALPHA, 4) * 4 == pytest.approx(ALPHA)
    assert bonferroni(0.05, 1) == 0.05
    for tests, budget in [(0, 0.05), (2, 0.0), (2, 1.0)]:
        with pytest.raises(ValueError, match=r"^tests:"):
            bonferroni(budget, tests)
