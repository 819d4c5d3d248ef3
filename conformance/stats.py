"""Goodness of fit against exact probabilities, with a fixed false-alarm budget.

The distribution tier compares counts of emitted tokens with float64 probabilities computed from
the target model. A convergence heuristic (vLLM's "distance shrinks faster than to random
distributions") has no stated error rate; here every check is a hypothesis test whose
false-alarm probability is fixed in advance (``ALPHA`` per test), and whose power against a known
alternative can be measured (``power``), so a pass means something and a failure is never luck.

* Statistic: the Cressie-Read power divergence with lambda = 2/3 by default (Cressie & Read
  1984 recommend it because its chi-square approximation is the most accurate, in the tail
  too), or the G-test (likelihood ratio, lambda = 0) or Pearson's chi-square (lambda = 1). All
  are asymptotically chi-square with ``cells - 1`` degrees of freedom.
* Level: the chi-square tail is an approximation, and at 1e-6 a relative error of tens of
  percent is normal (Monte Carlo, 2e6 null samples, n = 1536 over 38-64 pooled cells: actual /
  nominal at 1e-4 and 1e-5 was 1.24-1.50 for G, 1.08-1.55 for Pearson, 0.95-1.10 for
  Cressie-Read 2/3). So a test is run at ``NOMINAL_ALPHA = ALPHA / TAIL_SAFETY``: the budget
  holds even if the approximation is off by a factor ``TAIL_SAFETY`` in the far tail.
* Pooling: the asymptotics need every expected count reasonably large, so cells whose expected
  count is below ``min_expected`` are merged (smallest first) until every pooled cell reaches it.
  Cells of probability zero are never pooled: a single draw there is an impossible event and
  rejects outright (p-value 0), whatever the rest of the table says.
* p-value: the chi-square survival function ``Q(df/2, x/2)`` (regularised upper incomplete
  gamma), implemented here by series / continued fraction, because scipy is not a dependency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 1e-6          # false-alarm budget per test
TAIL_SAFETY = 2.0     # allowance for the chi-square approximation's error in the far tail
NOMINAL_ALPHA = ALPHA / TAIL_SAFETY  # the level tests are run at
MIN_EXPECTED = 10.0   # pooling threshold; stricter than the textbook 5 because ALPHA is a far tail
CR_LAMBDA = 2.0 / 3.0
METHODS = ("cr", "g", "pearson")

_EPS = 1e-15
_TINY = 1e-300
_MAX_ITER = 100_000


def _prefactor(a: float, x: float) -> float:
    """``x^a e^-x / Gamma(a)``, in logs so large arguments do not overflow."""
    return math.exp(a * math.log(x) - x - math.lgamma(a))


def _lower_series(a: float, x: float) -> float:
    """Regularised lower gamma P(a, x) by its power series; converges fast for x < a + 1."""
    term = total = 1.0 / a
    n = a
    for _ in range(_MAX_ITER):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * _EPS:
            return total * _prefactor(a, x)
    raise ArithmeticError(f"gamma series did not converge (a={a}, x={x})")


def _upper_fraction(a: float, x: float) -> float:
    """Regularised upper gamma Q(a, x) by its continued fraction (modified Lentz), for
    x >= a + 1; it keeps full relative precision in the far tail, where 1 - P would not."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return h * _prefactor(a, x)
    raise ArithmeticError(f"gamma continued fraction did not converge (a={a}, x={x})")


def gammaincc(a: float, x: float) -> float:
    """Regularised upper incomplete gamma ``Q(a, x) = Gamma(a, x) / Gamma(a)``."""
    if not a > 0 or not x >= 0 or math.isnan(x):
        raise ValueError(f"gammaincc: need a > 0 and x >= 0, got a={a}, x={x}")
    if x == 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return _upper_fraction(a, x)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df: must be >= 1, got {df}")
    return gammaincc(df / 2.0, max(x, 0.0) / 2.0)


def chi2_isf(p: float, df: int) -> float:
    """The critical value ``x`` with ``chi2_sf(x, df) == p`` (bisection; sf is monotone)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: must be in (0, 1), got {p}")
    lo, hi = 0.0, max(1.0, 2.0 * df)
    while chi2_sf(hi, df) > p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if chi2_sf(mid, df) > p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


# --- pooling and the test ----------------------------------------------------------------------

@dataclass(frozen=True)
class Pooling:
    """How cells map onto the tested cells: ``groups[j]`` lists the original cells pooled into
    tested cell j; ``impossible`` lists cells of probability zero (never pooled)."""

    groups: tuple[tuple[int, ...], ...]
    impossible: tuple[int, ...]

    @property
    def df(self) -> int:
        return len(self.groups) - 1

    def matrix(self, cells: int) -> np.ndarray:
        """A ``[cells, len(groups)]`` 0/1 matrix: ``counts @ matrix`` gives pooled counts."""
        m = np.zeros((cells, len(self.groups)))
        for j, group in enumerate(self.groups):
            m[list(group), j] = 1.0
        return m


def pool_cells(expected: Sequence[float] | np.ndarray, min_expected: float = MIN_EXPECTED
               ) -> Pooling:
    """Merge the cells of smallest expected count until every pooled cell reaches
    ``min_expected`` (or only one cell is left). Depends on the null only, never on the
    observations, so the test's level is unaffected by the pooling."""
    e = np.asarray(expected, dtype=np.float64)
    impossible = tuple(int(i) for i in np.flatnonzero(e <= 0.0))
    groups: list[tuple[list[int], float]] = [([int(i)], float(e[i]))
                                             for i in np.flatnonzero(e > 0.0)]
    groups.sort(key=lambda g: (g[1], g[0][0]))
    while len(groups) > 1 and groups[0][1] < min_expected:
        (a, ea), (b, eb) = groups[0], groups[1]
        groups = sorted([(sorted(a + b), ea + eb), *groups[2:]], key=lambda g: (g[1], g[0][0]))
    ordered = sorted(groups, key=lambda g: g[0][0])
    return Pooling(tuple(tuple(g) for g, _ in ordered), impossible)


def _statistic(observed: np.ndarray, expected: np.ndarray, method: str) -> np.ndarray:
    """Row-wise statistic; ``observed``/``expected`` are ``[..., cells]``."""
    if method == "cr":
        lam = CR_LAMBDA
        terms = observed * ((observed / expected) ** lam - 1.0)
        return 2.0 / (lam * (lam + 1.0)) * terms.sum(axis=-1)
    if method == "g":
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(observed > 0, observed * np.log(observed / expected), 0.0)
        return 2.0 * terms.sum(axis=-1)
    if method == "pearson":
        return ((observed - expected) ** 2 / expected).sum(axis=-1)
    raise ValueError(f"method: must be one of {METHODS}, got {method!r}")


@dataclass(frozen=True)
class GofResult:
    """One goodness-of-fit test: statistic, degrees of freedom, p-value and the verdict."""

    n: int
    cells: int               # tested cells after pooling
    df: int
    statistic: float
    p_value: float
    alpha: float
    impossible_hits: int     # draws in cells of probability zero (each alone rejects)
    method: str

    @property
    def rejected(self) -> bool:
        return self.p_value < self.alpha

    def summary(self) -> str:
        extra = f", {self.impossible_hits} draws of probability 0" if self.impossible_hits else ""
        name = {"cr": "CR(2/3)", "g": "G", "pearson": "X2"}[self.method]
        return (f"{name}={self.statistic:.2f} on {self.df} df over {self.cells} "
                f"pooled cells, n={self.n}, p={self.p_value:.3g} (alpha {self.alpha:g}){extra}")


def _null(probs: Sequence[float] | np.ndarray) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or (p < 0).any() or not math.isclose(float(p.sum()), 1.0, abs_tol=1e-9):
        raise ValueError("probs: must be a 1-d probability vector summing to 1")
    return p / p.sum()


def gof_test(counts: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray,
             alpha: float = NOMINAL_ALPHA, method: str = "cr",
             min_expected: float = MIN_EXPECTED) -> GofResult:
    """Test observed ``counts`` against exact cell probabilities ``probs`` (same order)."""
    if method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {method!r}")
    observed = np.asarray(counts, dtype=np.float64)
    p = _null(probs)
    if observed.shape != p.shape or (observed < 0).any():
        raise ValueError(f"counts: need {p.shape[0]} non-negative counts, got {observed.shape}")
    n = int(observed.sum())
    if n == 0:
        raise ValueError("counts: no observations")
    pooling = pool_cells(n * p, min_expected)
    hits = int(observed[list(pooling.impossible)].sum()) if pooling.impossible else 0
    m = pooling.matrix(p.shape[0])
    if pooling.df < 1:  # one possible cell: only the impossible draws can be tested
        stat, p_value = 0.0, 1.0
    else:
        stat = float(_statistic(observed @ m, n * (p @ m), method))
        p_value = chi2_sf(stat, pooling.df)
    if hits:
        p_value = 0.0
    return GofResult(n, len(pooling.groups), pooling.df, stat, p_value, alpha, hits, method)


def power(p_null: Sequence[float] | np.ndarray, p_alt: Sequence[float] | np.ndarray, n: int,
          alpha: float = NOMINAL_ALPHA, trials: int = 2000,
          rng: np.random.Generator | None = None, method: str = "cr",
          min_expected: float = MIN_EXPECTED) -> float:
    """Monte Carlo power: the fraction of ``trials`` samples of size ``n`` drawn from ``p_alt``
    that ``gof_test`` against ``p_null`` rejects at ``alpha``. Pooling and the critical value
    depend on the null and ``n`` only, so they are computed once."""
    p0 = _null(p_null)
    p1 = _null(p_alt)
    if p0.shape != p1.shape:
        raise ValueError(f"p_alt: {p1.shape[0]} cells, p_null has {p0.shape[0]}")
    rng = rng if rng is not None else np.random.default_rng(0)
    counts = rng.multinomial(n, p1, size=trials).astype(np.float64)
    pooling = pool_cells(n * p0, min_expected)
    impossible = (counts[:, list(pooling.impossible)].sum(axis=1) > 0 if pooling.impossible
                  else np.zeros(trials, dtype=bool))
    if pooling.df < 1:
        return float(impossible.mean())
    m = pooling.matrix(p0.shape[0])
    stats = _statistic(counts @ m, n * (p0 @ m), method)
    critical = chi2_isf(alpha, pooling.df)
    return float(((stats > critical) | impossible).mean())
