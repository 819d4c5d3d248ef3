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
  rejects outright (p-value 0), whatever the rest of the table says; the statistic then
  compares the possible draws with the null on its support.
* Computation: statistic and p-value (the chi-square survival function) come from
  ``scipy.stats.power_divergence``; ``power`` applies it to all its Monte Carlo samples at once
  and compares with the critical value ``scipy.stats.chi2.isf``. Pooling, the impossible
  draws and the level are this module's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2, power_divergence

ALPHA = 1e-6          # false-alarm budget per test
TAIL_SAFETY = 2.0     # allowance for the chi-square approximation's error in the far tail
NOMINAL_ALPHA = ALPHA / TAIL_SAFETY  # the level tests are run at
MIN_EXPECTED = 10.0   # pooling threshold; stricter than the textbook 5 because ALPHA is a far tail
CR_LAMBDA = 2.0 / 3.0
METHODS = ("cr", "g", "pearson")

# scipy.stats.power_divergence's lambda_ for each method
_LAMBDA: dict[str, float | str] = {"cr": CR_LAMBDA, "g": "log-likelihood", "pearson": "pearson"}


def bonferroni(budget: float, tests: int) -> float:
    """The level of each of ``tests`` tests that keeps the probability of any false alarm
    among them under ``budget`` (the union bound: whatever their dependence)."""
    if tests < 1 or not 0.0 < budget < 1.0:
        raise ValueError(f"tests: need >= 1 test and a budget in (0, 1), got {tests}, {budget}")
    return budget / tests


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


@dataclass(frozen=True)
class GofResult:
    """One goodness-of-fit test: statistic, degrees of freedom, p-value and the verdict."""

    n: int
    cells: int               # tested cells after pooling
    df: int
    statistic: float         # over the possible draws
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
    hits = int(observed[list(pooling.impossible)].sum())
    m = pooling.matrix(p.shape[0])
    pooled = observed @ m
    possible = float(pooled.sum())  # n, less the impossible draws
    if pooling.df < 1 or possible == 0:  # nothing to compare: only impossible draws are tested
        stat, p_value = 0.0, 1.0
    else:
        # Expected counts for the possible draws only: scipy requires equal totals, and the
        # impossible draws are judged on their own below (with none, this is ``n * p``).
        result = power_divergence(pooled, possible * (p @ m), lambda_=_LAMBDA[method])
        stat, p_value = float(result.statistic), float(result.pvalue)
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
    if method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {method!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha: must be in (0, 1), got {alpha}")
    p0 = _null(p_null)
    p1 = _null(p_alt)
    if p0.shape != p1.shape:
        raise ValueError(f"p_alt: {p1.shape[0]} cells, p_null has {p0.shape[0]}")
    rng = rng if rng is not None else np.random.default_rng(0)
    counts = rng.multinomial(n, p1, size=trials)
    pooling = pool_cells(n * p0, min_expected)
    rejected = counts[:, list(pooling.impossible)].sum(axis=1) > 0
    if pooling.df < 1:
        return float(rejected.mean())
    # Samples with an impossible draw are rejected already; the rest have all n draws in the
    # possible cells, so their totals match ``n * p0`` as scipy requires.
    m = pooling.matrix(p0.shape[0])
    rest = ~rejected
    stats = power_divergence(counts[rest] @ m, n * (p0 @ m), axis=-1,
                             lambda_=_LAMBDA[method]).statistic
    rejected[rest] = stats > chi2.isf(alpha, pooling.df)
    return float(rejected.mean())
