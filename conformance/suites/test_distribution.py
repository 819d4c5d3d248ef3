"""Tier distribution: sampled tokens follow the target distribution exactly.

Speculative sampling must be lossless: whatever the draft proposes, every emitted token is
distributed as the target model says. Greedy identity (the lossless tier) cannot see a biased
sampler, so this tier compares emitted tokens with exact float64 target probabilities in a
hypothesis test with a fixed false-alarm budget (``stats.ALPHA`` = 1e-6 per test), and proves
the test has teeth with a negative control whose rejection power is computed, not hoped for.

Design:
* One prompt (of the profile's shortest few, the one with the most spread-out law),
  ``SAMPLES`` requests differing only in their seed, each ``TOKENS`` = 3 tokens: t1 comes from
  the prefill (the plain path); under EAGLE, t2 and t3 come from verify (t2 at depth 0 of the
  tree rooted at t1; t3 at depth 1 when t2 was an accepted draft, otherwise from the next
  verify, rooted at t2). Under ``--spec none`` the same test checks plain sampling.
* Restricted support: ``top_k`` = 4, so the joint law of (t1, t2, t3) lives on at most 64
  cells, each with an exact probability ``p(t1) p(t2 | t1) p(t3 | t1, t2)`` from the reference
  oracle (an unmodified engine's scoring prefill, float64 after temperature / top-k). The whole
  joint is tested at once, so every request counts (conditioning on one t1 would waste most of
  them), and the first-token (plain) law is checked with the speculative ones. The temperature
  is not 1, so a verifier that ignores it or applies it twice is caught as well.
* Statistic: Cressie-Read 2/3 (the best-calibrated chi-square tail among the power
  divergences), run at ``stats.NOMINAL_ALPHA`` = ALPHA / 2 to absorb the approximation's
  error in the far tail; cells with expected count < ``stats.MIN_EXPECTED`` pooled (the
  pooling depends on the null only); any draw outside the support rejects outright.
* Independence: every request has its own seed; the reference engine derives one generator per
  (seed, output position), so draws do not depend on batching.
* Negative control: the same procedure against the reference engine's ``biased_verify_sampler``
  mutant (bonus drawn from ``p`` instead of the residual), on the same model and draft, always
  as an EAGLE chain (see ``control_spec``), whatever the backend under test. Its exact output
  law follows from the draft trees it verified (it records them), which gives its rejection
  power at ``SAMPLES`` by Monte Carlo; the tier requires power >= ``MIN_POWER``, that the
  derived law fits the control's own run, and that the control run is rejected.

Everything is seeded, so the outcome is reproducible run to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from conformance import stats
from conformance.adapter import Backend, OpenConfig, SamplingParams, SpecConfig
from conformance.backends.mutants import mutant_backend, verified_draft_trees
from conformance.distribution import (
    JointLaw,
    Trees,
    biased_bonus,
    exact_law,
    first_draft_accept_rate,
    reference_bonus,
    speculative_law,
)
from conformance.driver import Driver
from conformance.plugin import SuiteContext
from conformance.specs import SPECS

# Both checks submit every request, then only step to the end (nothing acts between steps):
# run-to-completion backends are certified too.
pytestmark = [pytest.mark.specgate_tier("distribution"),
              pytest.mark.specgate_requires("sampling")]

SAMPLES = 1536            # requests per run (the backend under test; the negative control)
BATCH = 512               # max_running_requests: large batches keep the run within budget
TOKENS = 3                # t1 (prefill), t2 and t3 (verify)
TOP_K = 4                 # restricted support: at most TOP_K ** TOKENS cells
TEMPERATURE = 1.3
NEGATIVE_CONTROL = "biased_verify_sampler"
MIN_POWER = 0.99
POWER_TRIALS = 4000
CANDIDATE_PROMPTS = 4     # the prompt is the most spread-out of this many shortest ones


def sampling_params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=TOKENS, temperature=TEMPERATURE, top_k=TOP_K,
                          ignore_eos=True, seed=seed)


# --- one run -----------------------------------------------------------------------------

@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    steps: int


def sample(backend: Backend, sg: SuiteContext, spec: SpecConfig | None,
           prompt: tuple[int, ...], inspect: Callable[[object], None] | None = None) -> Run:
    """``SAMPLES`` seeded requests through the Driver (event-stream and memory checks on)."""
    cfg = sg.open_config(spec, max_running_requests=BATCH,
                         kv_pool_tokens=BATCH * (len(prompt) + 64),
                         max_prefill_tokens=max(2048, BATCH * len(prompt)))
    start = time.perf_counter()  # one torch thread, as the whole suite (the ``sg`` fixture)
    handle = backend.open(cfg)
    try:
        driver = Driver(handle, backend.capabilities(), overlap=spec is not None and spec.overlap)
        for i in range(SAMPLES):
            driver.submit(f"d{i}", list(prompt), sampling_params(i))
        outcomes = driver.run(64 + SAMPLES * (TOKENS + 2))
        if inspect is not None:
            inspect(handle)
    finally:
        handle.close()
    outputs = [outcomes[f"d{i}"].output_ids for i in range(SAMPLES)]
    bad = [(i, o) for i, o in enumerate(outputs) if len(o) != TOKENS]
    assert not bad, f"{len(bad)} requests did not emit {TOKENS} tokens: {bad[:3]}"
    return Run(outputs, time.perf_counter() - start, driver.steps)


def check(law: JointLaw, run: Run) -> stats.GofResult:
    return stats.gof_test(law.counts(run.outputs), law.probs_with_outside)


RecordProperty = Callable[[str, object], None]


def _figures(record_property: RecordProperty, prefix: str, law: JointLaw, run: Run,
             result: stats.GofResult) -> None:
    record_property(f"{prefix}samples", SAMPLES)
    record_property(f"{prefix}support_cells", len(law.cells))
    record_property(f"{prefix}tested_cells", result.cells)
    record_property(f"{prefix}statistic", round(result.statistic, 3))
    record_property(f"{prefix}df", result.df)
    record_property(f"{prefix}p_value", float(f"{result.p_value:.4g}"))
    record_property(f"{prefix}outside_support", result.impossible_hits)
    record_property(f"{prefix}sample_seconds", round(run.seconds, 2))
    record_property(f"{prefix}steps", run.steps)


@pytest.fixture(scope="module")
def law(sg: SuiteContext) -> JointLaw:
    """Of the ``CANDIDATE_PROMPTS`` shortest prompts (short ones prefill cheaply), the one whose
    exact joint law has the most entropy: a peaked law (a confident code model after an
    obvious prefix) concentrates the draws on few cells and hides biases. The choice depends on
    the null only, never on sampled tokens, so it leaves the test's level alone."""
    params = sampling_params(0)

    def probs_of(ids: tuple[int, ...]) -> torch.Tensor:
        return sg.oracle.next_token_probs(ids, params)

    cases = sorted(sg.prompts, key=lambda c: (len(c.ids), c.id))[:CANDIDATE_PROMPTS]
    laws = [exact_law(probs_of, c.id, c.ids, TOKENS) for c in cases]
    return max(laws, key=lambda law: law.entropy_bits)


def test_sampled_tokens_follow_target_distribution(sg: SuiteContext, law: JointLaw,
                                                   record_property: RecordProperty) -> None:
    """The backend's first three sampled tokens follow the target's exact joint law.
    Requires: sampling."""
    run = sample(sg.backend, sg, sg.spec.configs[0], law.prompt)
    result = check(law, run)
    _figures(record_property, "", law, run, result)
    record_property("alpha_budget", stats.ALPHA)
    record_property("alpha_nominal", stats.NOMINAL_ALPHA)
    record_property("prompt", law.prompt_id)
    record_property("entropy_bits", round(law.entropy_bits, 3))
    assert not result.rejected, (
        f"emitted tokens do not follow the target distribution: {result.summary()}; "
        f"worst cells: {worst_cells(law, run)}")


def worst_cells(law: JointLaw, run: Run, top: int = 3) -> str:
    """The cells whose counts deviate most (largest deviance terms), for a failure message."""
    counts = law.counts(run.outputs)
    outside = int(counts[-1])
    expected = SAMPLES * law.probs
    with np.errstate(divide="ignore", invalid="ignore"):
        contrib = np.where(counts[:-1] > 0,
                           counts[:-1] * np.log(counts[:-1] / expected), 0.0) - (
            counts[:-1] - expected)
    order = np.argsort(-np.abs(contrib))[:top]
    cells = ", ".join(f"{law.cells[i]}: {int(counts[i])} vs {expected[i]:.1f}" for i in order)
    return cells + (f"; {outside} outside the support" if outside else "")


# --- the negative control -----------------------------------------------------------------

def smallest_powerful_n(p_null: np.ndarray, p_alt: np.ndarray) -> int:
    """The smallest power-of-two sample size at which the control is rejected with power
    ``MIN_POWER``: how much margin ``SAMPLES`` has."""
    n = 16
    while n < SAMPLES and stats.power(p_null, p_alt, n, trials=POWER_TRIALS,
                                      rng=np.random.default_rng(1)) < MIN_POWER:
        n *= 2
    return n


def smallest_detectable_fraction(p_null: np.ndarray, p_alt: np.ndarray) -> float:
    """The smallest fraction ``s`` (halving from 1) such that the diluted bias
    ``p_null + s (p_alt - p_null)`` is still rejected at ``SAMPLES`` with power ``MIN_POWER``:
    how subtle a bias of the control's shape the tier catches."""
    s = 1.0
    while s > 1 / 64 and stats.power(p_null, p_null + s / 2 * (p_alt - p_null), SAMPLES,
                                     trials=POWER_TRIALS,
                                     rng=np.random.default_rng(2)) >= MIN_POWER:
        s /= 2
    return s


def control_spec(sg: SuiteContext, request: pytest.FixtureRequest) -> SpecConfig:
    """Always a chain (S=3), with the certified spec's algorithm and draft model (EAGLE under
    ``none``). A chain verifies one draft per node, so the control's bias is there to find; a
    wide tree can cover the whole top-k support with children, where the residual bug has
    (almost) nothing to bias and no test could have power. Under ``none`` the draft is
    ``--specgate-draft-model`` or the bundled head, which fits the bundled target only."""
    chain = SPECS["eagle"].configs[0]
    assert chain is not None, "the eagle spec's first configuration is the chain"
    spec = sg.spec.configs[0]
    if spec is not None:
        return replace(chain, algorithm=spec.algorithm, draft_model=spec.draft_model)
    draft = request.config.getoption("--specgate-draft-model")
    if draft:
        return replace(chain, draft_model=draft)
    if sg.model != OpenConfig().model:  # the bundled head was distilled from this target
        pytest.skip(f"the negative control needs an EAGLE draft for {sg.model}: pass "
                    "--specgate-draft-model")
    return chain


def test_negative_control_is_rejected(sg: SuiteContext, law: JointLaw,
                                      record_property: RecordProperty,
                                      request: pytest.FixtureRequest) -> None:
    """The same procedure must reject a subtly biased verifier, with power >= MIN_POWER.
    Requires: sampling (the control itself is the reference engine's mutant)."""
    spec = control_spec(sg, request)
    trees: Trees = {}

    def grab_trees(handle: object) -> None:  # the control mutant records them
        trees.update(verified_draft_trees(handle))

    run = sample(mutant_backend(NEGATIVE_CONTROL), sg, spec, law.prompt, grab_trees)
    result = check(law, run)
    _figures(record_property, "control_", law, run, result)

    # The control's exact law, from the trees it verified; its power at SAMPLES by Monte Carlo.
    p_alt = speculative_law(law, trees, biased_bonus, spec.num_steps)
    power = stats.power(law.probs, p_alt, SAMPLES, stats.NOMINAL_ALPHA, POWER_TRIALS,
                        np.random.default_rng(0))
    record_property("control_power", power)
    record_property("control_power_trials", POWER_TRIALS)
    record_property("control_n_at_min_power", smallest_powerful_n(law.probs, p_alt))
    record_property("control_detectable_fraction",
                    smallest_detectable_fraction(law.probs, p_alt))
    record_property("control_tv_distance", round(0.5 * float(np.abs(p_alt - law.probs).sum()),
                                                 4))
    record_property("control_first_draft_accept_rate",
                    round(first_draft_accept_rate(law, trees, spec.num_steps), 4))

    # Self-checks of the derivation: the correct scheme gives the target law on the same
    # trees, and the derived control law fits the control's own run.
    lossless = speculative_law(law, trees, reference_bonus, spec.num_steps)
    np.testing.assert_allclose(lossless, law.probs, rtol=1e-9, atol=1e-12,
                               err_msg="control law derivation broken: the reference scheme "
                                       "must give the target law")
    assert abs(p_alt.sum() - 1.0) < 1e-9, f"control law sums to {p_alt.sum()}"
    fits = stats.gof_test(law.counts(run.outputs), np.append(p_alt, 0.0))
    assert not fits.rejected, f"the control's derived law does not fit its run: {fits.summary()}"

    assert power >= MIN_POWER, (f"the tier is too weak: it rejects the {NEGATIVE_CONTROL} "
                                f"control with power {power:.3f} < {MIN_POWER} at n={SAMPLES}")
    assert result.rejected, (f"the {NEGATIVE_CONTROL} control was not rejected "
                             f"(power {power:.3f}): {result.summary()}")

