"""conformance.stats: the chi-square tail without scipy, pooling, the G-test and its power."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.stats import (
    ALPHA,
    CR_LAMBDA,
    NOMINAL_ALPHA,
    chi2_isf,
    chi2_sf,
    gammaincc,
    gof_test,
    pool_cells,
    power,
)


def closed_form_sf(x: float, df: int) -> float:
    """Chi-square survival in closed form: a Poisson sum for even df, erfc plus a series for
    odd df (Abramowitz & Stegun 26.4.4/26.4.5) — independent of the gamma code under test."""
    h = x / 2.0
    if df % 2 == 0:
        return math.exp(-h) * sum(h**k / math.factorial(k) for k in range(df // 2))
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(x) * math.exp(-h) / math.gamma(1.5)  # x^(1/2) e^(-x/2) / (2^(1/2) G(3/2))
    term /= math.sqrt(2.0)
    for k in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * k + 1)
    return total


@pytest.mark.parametrize(("x", "df", "want"), [
    (3.841458820694124, 1, 0.05),        # the familiar 5% point
    (6.634896601021214, 1, 0.01),
    (23.209251158954356, 10, 0.01),
    (18.307038053275146, 10, 0.05),
    (23.928126976934436, 1, 1e-6),      # the tier's budget, df 1
])
def test_known_quantiles(x: float, df: int, want: float) -> None:
    assert chi2_sf(x, df) == pytest.approx(want, rel=1e-9)
    assert chi2_isf(want, df) == pytest.approx(x, rel=1e-9)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 10, 15, 16, 31, 63, 64])
@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 3.0, 10.0, 30.0, 60.0, 150.0, 300.0])
def test_matches_closed_form(x: float, df: int) -> None:
    """Body and far tail, on both sides of the series / continued-fraction switch."""
    want = closed_form_sf(x, df)
    assert chi2_sf(x, df) == pytest.approx(want, rel=1e-10, abs=1e-300)


def test_edges() -> None:
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(-1.0, 3) == 1.0
    assert chi2_sf(math.inf, 3) == 0.0
    assert gammaincc(1.0, 2.0) == pytest.approx(math.exp(-2.0), rel=1e-14)
    with pytest.raises(ValueError):
        chi2_sf(1.0, 0)
    with pytest.raises(ValueError):
        gammaincc(-1.0, 1.0)
    with pytest.raises(ValueError):
        chi2_isf(0.0, 3)


def test_isf_roundtrip() -> None:
    for df in (1, 7, 15, 63):
        for p in (0.5, 1e-3, ALPHA, 1e-12):
            assert chi2_sf(chi2_isf(p, df), df) == pytest.approx(p, rel=1e-8)


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
    assert result.p_value == pytest.approx(chi2_sf(cr, 2))


def test_draw_of_probability_zero_rejects_outright() -> None:
    p = np.array([0.5, 0.5, 0.0])
    result = gof_test([500, 499, 1], p)
    assert result.impossible_hits == 1 and result.p_value == 0.0 and result.rejected


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="probs"):
        gof_test([1, 2], [0.5, 0.6])
    with pytest.raises(ValueError, match="counts"):
        gof_test([1, 2, 3], [0.5, 0.5])
    with pytest.raises(ValueError, match="counts"):
        gof_test([0, 0], [0.5, 0.5])
    with pytest.raises(ValueError, match="method"):
        gof_test([5, 5], [0.5, 0.5], method="ks")


@pytest.mark.parametrize(("alpha", "trials"), [(1e-2, 20_000), (1e-3, 100_000)])
def test_false_alarm_rate_is_calibrated(alpha: float, trials: int) -> None:
    """Under the null the rejection rate matches alpha where Monte Carlo can see it (expected
    200 and 100 rejections, +- 4 standard deviations; pooled small cells included)."""
    p = np.random.default_rng(3).dirichlet(np.ones(24) * 0.7)
    rate = power(p, p, 1500, alpha=alpha, trials=trials, rng=np.random.default_rng(4))
    expected = alpha * trials
    assert abs(rate * trials - expected) < 4 * expected**0.5, rate


def test_power_grows_with_sample_size() -> None:
    p = np.full(8, 1 / 8)
    q = p + np.array([0.02, -0.02, 0, 0, 0, 0, 0, 0])
    small = power(p, q, 500, trials=500, rng=np.random.default_rng(5))
    large = power(p, q, 50_000, trials=500, rng=np.random.default_rng(5))
    assert small < 0.1 and large > 0.99
    support = power([0.5, 0.5, 0.0], [0.49, 0.5, 0.01], 2000, trials=200)
    assert support == 1.0  # any draw outside the null's support rejects
