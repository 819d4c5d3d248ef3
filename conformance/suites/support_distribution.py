"""The distribution tier's design and its one run (``test_distribution.py`` documents the
design): the sampling settings and the sample sizes, seeded sampling through the Driver, the
goodness-of-fit test of a run against a joint law and the figures it records, and the Monte
Carlo power of that test against an alternative law."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.checks import stats
from conformance.checks.distribution import JointLaw
from conformance.contract import Backend, SamplingParams, SpecConfig
from conformance.repro.driver import Driver
from conformance.run.context import SuiteContext


@dataclass(frozen=True)
class Setting:
    """One sampling setting of the design."""

    name: str
    temperature: float
    top_k: int = -1
    top_p: float = 1.0

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=TOKENS, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, ignore_eos=True, seed=seed)


SETTINGS = (
    Setting("cool-top-k", 0.7, top_k=4),
    Setting("hot-top-k", 1.3, top_k=4),
    Setting("top-p", 0.8, top_p=0.6),
    Setting("top-k-top-p", 1.3, top_k=6, top_p=0.75),
)
GATE_SETTINGS = ("top-p", "top-k-top-p")  # the full profile runs every setting
# split over all four settings in both profiles: the gate's two are tested at the same level
# as in full (its family-wise false-alarm rate is then half the budget)
ALPHA_PER_SETTING = stats.bonferroni(stats.ALPHA, len(SETTINGS))
NOMINAL_ALPHA = ALPHA_PER_SETTING / stats.TAIL_SAFETY  # the level each setting is tested at
SAMPLES = {"gate": 512, "full": 1536}  # requests per setting and run, by profile
BATCH = 512               # max_running_requests: large batches keep the run within budget
TOKENS = 3                # t1 (prefill), t2 and t3 (verify)
MAX_CELLS = 64            # the largest joint support a setting's prompt may have
MIN_POWER = 0.99
POWER_TRIALS = 4000
CANDIDATE_PROMPTS = 4     # the prompt is the most spread-out of this many shortest ones


def samples(sg: SuiteContext) -> int:
    return SAMPLES[sg.profile.name]


def settings_for(profile: str) -> tuple[Setting, ...]:
    return SETTINGS if profile == "full" else tuple(
        s for s in SETTINGS if s.name in GATE_SETTINGS)


# --- one run -----------------------------------------------------------------------------

@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    steps: int


def sample(backend: Backend, sg: SuiteContext, spec: SpecConfig | None, setting: Setting,
           prompt: tuple[int, ...], inspect: Callable[[object], None] | None = None) -> Run:
    """``samples(sg)`` seeded requests through the Driver (event-stream and memory checks on)."""
    n = samples(sg)
    cfg = sg.open_config(spec, max_running_requests=BATCH,
                         kv_pool_tokens=BATCH * (len(prompt) + 64),
                         max_prefill_tokens=max(2048, BATCH * len(prompt)))
    start = time.perf_counter()  # one torch thread, as the whole suite (the ``sg`` fixture)
    handle = backend.open(cfg)
    try:
        driver = Driver(handle, backend.capabilities(), overlap=spec is not None and spec.overlap)
        for i in range(n):
            driver.submit(f"d{i}", list(prompt), setting.params(i))
        outcomes = driver.run(64 + n * (TOKENS + 2))
        if inspect is not None:
            inspect(handle)
    finally:
        handle.close()
    outputs = [outcomes[f"d{i}"].output_ids for i in range(n)]
    bad = [(i, o) for i, o in enumerate(outputs) if len(o) != TOKENS]
    assert not bad, f"{len(bad)} requests did not emit {TOKENS} tokens: {bad[:3]}"
    return Run(outputs, time.perf_counter() - start, driver.steps)


def check(law: JointLaw, run: Run) -> stats.GofResult:
    return stats.gof_test(law.counts(run.outputs), law.probs_with_outside, NOMINAL_ALPHA)


RecordProperty = Callable[[str, object], None]


def record_figures(record_property: RecordProperty, prefix: str, law: JointLaw, run: Run,
                   result: stats.GofResult) -> None:
    """A run's test figures as the check's properties (``prefix``: ``control_`` for the
    negative control's run)."""
    record_property(f"{prefix}samples", len(run.outputs))
    record_property(f"{prefix}support_cells", len(law.cells))
    record_property(f"{prefix}tested_cells", result.cells)
    record_property(f"{prefix}statistic", round(result.statistic, 3))
    record_property(f"{prefix}df", result.df)
    record_property(f"{prefix}p_value", float(f"{result.p_value:.4g}"))
    record_property(f"{prefix}outside_support", result.impossible_hits)
    record_property(f"{prefix}sample_seconds", round(run.seconds, 2))
    record_property(f"{prefix}steps", run.steps)


def record_setting_figures(record_property: RecordProperty, setting: Setting, law: JointLaw
                           ) -> None:
    """The setting, the false-alarm levels and the prompt the law was taken on."""
    record_property("setting", f"{setting.name}: temperature {setting.temperature}, "
                               f"top_k {setting.top_k}, top_p {setting.top_p}")
    record_property("alpha_budget", stats.ALPHA)
    record_property("alpha_setting", ALPHA_PER_SETTING)
    record_property("alpha_nominal", NOMINAL_ALPHA)
    record_property("prompt", law.prompt_id)
    record_property("entropy_bits", round(law.entropy_bits, 3))


def worst_cells(law: JointLaw, run: Run, top: int = 3) -> str:
    """The cells whose counts deviate most (largest deviance terms), for a failure message."""
    counts = law.counts(run.outputs)
    outside = int(counts[-1])
    expected = len(run.outputs) * law.probs
    with np.errstate(divide="ignore", invalid="ignore"):
        contrib = np.where(counts[:-1] > 0,
                           counts[:-1] * np.log(counts[:-1] / expected), 0.0) - (
            counts[:-1] - expected)
    order = np.argsort(-np.abs(contrib))[:top]
    cells = ", ".join(f"{law.cells[i]}: {int(counts[i])} vs {expected[i]:.1f}" for i in order)
    return cells + (f"; {outside} outside the support" if outside else "")


# --- power ---------------------------------------------------------------------------------

def power_at(p_null: np.ndarray, p_alt: np.ndarray, n: int, seed: int = 0) -> float:
    return stats.power(p_null, p_alt, n, NOMINAL_ALPHA, POWER_TRIALS,
                       np.random.default_rng(seed))


def smallest_powerful_n(p_null: np.ndarray, p_alt: np.ndarray, n: int) -> int:
    """The smallest power-of-two sample size (up to ``n``) at which the control is rejected
    with power ``MIN_POWER``: how much margin ``n`` has."""
    m = 16
    while m < n and power_at(p_null, p_alt, m, seed=1) < MIN_POWER:
        m *= 2
    return m


def smallest_detectable_fraction(p_null: np.ndarray, p_alt: np.ndarray, n: int) -> float:
    """The smallest fraction ``s`` (halving from 1) such that the diluted bias
    ``p_null + s (p_alt - p_null)`` is still rejected at ``n`` with power ``MIN_POWER``:
    how subtle a bias of the control's shape the tier catches."""
    s = 1.0
    while s > 1 / 64 and power_at(p_null, p_null + s / 2 * (p_alt - p_null), n,
                                  seed=2) >= MIN_POWER:
        s /= 2
    return s
