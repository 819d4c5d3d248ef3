"""Tier distribution: sampled tokens follow the target distribution exactly.

Speculative sampling must be lossless: whatever the draft proposes, every emitted token is
distributed as the target model says. Greedy identity (the lossless tier) cannot see a biased
sampler, so this tier compares emitted tokens with exact float64 target probabilities in
hypothesis tests with a fixed false-alarm budget, and proves the tests have teeth with negative
controls whose rejection power is computed, not hoped for.

Design:
* A fixed design of sampling settings (``SETTINGS``): temperature below and above 1 under
  top-k, top-p alone, top-k with top-p. A verifier that ignores top-p, applies the temperature
  differently from the plain sampler, or filters in another order than the target's, emits
  another law under some of them. (``SamplingParams`` has no min-p, so none is tested.)
  Each setting is tested against the exact target law under that setting (the oracle applies
  temperature / top-k / top-p by its own rule, ``conformance.checks.sampling_law``, never the
  engine's sampler, so a sampler bug shared by plain decoding and verify is not in the law).
* False alarms: the budget ``stats.ALPHA`` = 1e-6 is the whole test's, split over the settings
  by Bonferroni (``ALPHA_PER_SETTING`` = ALPHA / 4), and each setting is run at that over
  ``stats.TAIL_SAFETY`` to absorb the chi-square approximation's error in the far tail.
* Per setting, one prompt (of the profile's ``CANDIDATE_PROMPTS`` shortest, the one with the
  most spread-out law whose joint support has at most ``MAX_CELLS`` cells), ``samples`` requests
  differing only in their seed, each ``TOKENS`` = 3 tokens: t1 comes from the prefill (the
  plain path); under EAGLE, t2 and t3 come from verify (t2 at depth 0 of the tree rooted at
  t1; t3 at depth 1 when t2 was an accepted draft, otherwise from the next verify, rooted at
  t2). Under ``--spec none`` the same test checks plain sampling.
* Restricted support: the joint law of (t1, t2, t3), each cell with an exact probability
  ``p(t1) p(t2 | t1) p(t3 | t1, t2)`` from the reference oracle, is tested at once (every
  request counts, and the plain first-token law is checked with the speculative ones). Top-k 4
  bounds it by 64 cells. Top-p alone bounds nothing: its nucleus is a handful of tokens after a
  confident prefix and hundreds after an open one, so its setting (temperature 0.8, top-p 0.6)
  is one that keeps the nucleus small on short code prompts, and the prompt choice skips any
  support over ``MAX_CELLS`` (the walk stops there, so a huge support costs nothing).
* Statistic: Cressie-Read 2/3 (the best-calibrated chi-square tail among the power
  divergences); cells with expected count < ``stats.MIN_EXPECTED`` pooled (the pooling depends
  on the null only); any draw outside the support rejects outright, which is how a verifier
  that ignores top-p (or widens the nucleus by a wrong temperature) is caught at any sample size.
* Gate time: each setting costs two sampling runs (its check and its negative control), and
  a run is model compute at batch 512, so the gate runs the two settings that between them
  cover temperature below and above 1, top-k, top-p and top-k with top-p (``GATE_SETTINGS``:
  top-p, top-k-top-p) at ``SAMPLES["gate"]`` = 512 requests each; the full profile runs all
  four at 1536. The two gate settings are the ones with power against both verify-path
  parameter bugs (the top-k-only settings cannot see a dropped top-p), so the settings left to
  the full profile add coverage of top-k alone, not power against a known bug
  (``docs/measurements.md`` has the figures). The negative controls' power at 512 is measured
  and required in every run (see below), so the smaller sample is shown to be enough rather
  than assumed.
* Independence: every request has its own seed; the reference engine derives one generator per
  (seed, output position), so draws do not depend on batching.
* Negative controls: (1) per setting, the same procedure against the reference engine's
  ``biased_verify_sampler`` mutant (bonus drawn from ``p`` instead of the residual), on the same
  model and draft, always as an EAGLE chain (see ``control_spec``), whatever the backend under
  test. Its exact output law follows from the draft trees it verified (it records them), which
  gives its rejection power by Monte Carlo; each setting requires power >= ``MIN_POWER``, that
  the derived law fits the control's own run, and that the control run is rejected. (2) The
  verify-path parameter bugs of the bug zoo (``mutants.VERIFY_PARAM_BUGS``: top-p dropped,
  temperature dropped): an exact verifier against the wrong distribution emits that
  distribution whatever the drafts, so their laws come from the oracle alone; the tier's
  power against each is reported per setting, and the best setting's power (a lower bound on
  the design's) must reach ``MIN_POWER``. Both kinds of control test the suite, not the
  backend (one runs a mutant, the other the oracle alone): they are marked as self-checks and
  the certificate reports them apart from the backend's passes.

Everything is seeded, so the outcome is reproducible run to run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest

from conformance.backends.mutants import mutant_backend
from conformance.backends.mutants.sampling import VERIFY_PARAM_BUGS, verified_draft_trees
from conformance.checks import stats
from conformance.checks.distribution import (
    JointLaw,
    SupportTooLarge,
    Trees,
    biased_bonus,
    exact_law,
    first_draft_accept_rate,
    reference_bonus,
    speculative_law,
    verify_misapplied_law,
)
from conformance.contract import Backend, OpenConfig, SamplingParams, SpecConfig
from conformance.plan.specs import SPECS
from conformance.repro.driver import Driver
from conformance.run.context import SuiteContext

# Both checks submit every request, then only step to the end (nothing acts between steps):
# run-to-completion backends are certified too.
pytestmark = [pytest.mark.specgate_tier("distribution"),
              pytest.mark.specgate_requires("sampling")]


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
NEGATIVE_CONTROL = "biased_verify_sampler"
MIN_POWER = 0.99
POWER_TRIALS = 4000
CANDIDATE_PROMPTS = 4     # the prompt is the most spread-out of this many shortest ones


def samples(sg: SuiteContext) -> int:
    return SAMPLES[sg.profile.name]


def settings_for(profile: str) -> tuple[Setting, ...]:
    return SETTINGS if profile == "full" else tuple(
        s for s in SETTINGS if s.name in GATE_SETTINGS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "setting" in metafunc.fixturenames:
        chosen = settings_for(metafunc.config.getoption("--specgate-profile"))
        metafunc.parametrize("setting", chosen, ids=lambda s: s.name)


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


def _figures(record_property: RecordProperty, prefix: str, law: JointLaw, run: Run,
             result: stats.GofResult) -> None:
    record_property(f"{prefix}samples", len(run.outputs))
    record_property(f"{prefix}support_cells", len(law.cells))
    record_property(f"{prefix}tested_cells", result.cells)
    record_property(f"{prefix}statistic", round(result.statistic, 3))
    record_property(f"{prefix}df", result.df)
    record_property(f"{prefix}p_value", float(f"{result.p_value:.4g}"))
    record_property(f"{prefix}outside_support", result.impossible_hits)
    record_property(f"{prefix}sample_seconds", round(run.seconds, 2))
    record_property(f"{prefix}steps", run.steps)


LawOf = Callable[[Setting], JointLaw]


@pytest.fixture(scope="module")
def law_of(sg: SuiteContext) -> LawOf:
    """Per setting (computed once): of the ``CANDIDATE_PROMPTS`` shortest prompts (short ones
    prefill cheaply) whose joint support has at most ``MAX_CELLS`` cells, the one whose exact
    joint law has the most entropy: a peaked law (a confident code model after an obvious
    prefix) concentrates the draws on few cells and hides biases. The choice depends on the
    null only, never on sampled tokens, so it leaves the test's level alone."""
    cases = sorted(sg.prompts, key=lambda c: (len(c.ids), c.id))[:CANDIDATE_PROMPTS]
    laws: dict[Setting, JointLaw] = {}

    def of(setting: Setting) -> JointLaw:
        if setting not in laws:
            params = setting.params(0)
            fitting = []
            for case in cases:
                try:
                    fitting.append(exact_law(
                        lambda ids: sg.oracle.next_token_probs(ids, params), case.id, case.ids,
                        TOKENS, MAX_CELLS))
                except SupportTooLarge:
                    continue
            if not fitting:
                # A property of the model, not of the backend (a near-uniform model, e.g. an
                # untrained one, spreads top-p over hundreds of tokens): nothing to test here.
                pytest.skip(f"not applicable: under setting {setting.name} no candidate prompt "
                            f"of this model has a joint support of at most {MAX_CELLS} cells")
            laws[setting] = max(fitting, key=lambda law: law.entropy_bits)
        return laws[setting]

    return of


def _setting_figures(record_property: RecordProperty, setting: Setting, law: JointLaw) -> None:
    record_property("setting", f"{setting.name}: temperature {setting.temperature}, "
                               f"top_k {setting.top_k}, top_p {setting.top_p}")
    record_property("alpha_budget", stats.ALPHA)
    record_property("alpha_setting", ALPHA_PER_SETTING)
    record_property("alpha_nominal", NOMINAL_ALPHA)
    record_property("prompt", law.prompt_id)
    record_property("entropy_bits", round(law.entropy_bits, 3))


def test_sampled_tokens_follow_target_distribution(sg: SuiteContext, law_of: LawOf,
                                                   setting: Setting,
                                                   record_property: RecordProperty) -> None:
    """The backend's first three sampled tokens follow the target's exact joint law under
    each sampling setting. Requires: sampling."""
    law = law_of(setting)
    run = sample(sg.backend, sg, sg.spec.configs[0], setting, law.prompt)
    result = check(law, run)
    _figures(record_property, "", law, run, result)
    _setting_figures(record_property, setting, law)
    assert not result.rejected, (
        f"emitted tokens do not follow the target distribution under {setting.name}: "
        f"{result.summary()}; worst cells: {worst_cells(law, run)}")


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


# --- the negative controls ----------------------------------------------------------------

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


def control_spec(sg: SuiteContext, request: pytest.FixtureRequest) -> SpecConfig:
    """Always a chain (S=3), with the certified spec's algorithm and draft model (EAGLE under
    ``none`` and under n-gram lookup). A chain verifies one draft per node, so the control's
    bias is there to find; a wide tree can cover the whole top-k support with children, where
    the residual bug has (almost) nothing to bias and no test could have power. An n-gram
    draft copies the prompt, and on the tier's short prompts what it copies lies outside the
    nucleus (its first drafts are never accepted): the biased residual then emits the target
    law itself and no control could have power there, so the control shows the procedure's
    power with drafts that do land in it. Under ``none`` and n-gram the draft is
    ``--specgate-draft-model`` or the bundled head, which fits the bundled target only."""
    chain = SPECS["eagle"].configs[0]
    assert chain is not None, "the eagle spec's first configuration is the chain"
    spec = sg.spec.configs[0]
    if spec is not None and spec.needs_draft_model:
        return replace(chain, algorithm=spec.algorithm, draft_model=spec.draft_model)
    draft = request.config.getoption("--specgate-draft-model")
    if draft:
        return replace(chain, draft_model=draft)
    if sg.model != OpenConfig().model:  # the bundled head was distilled from this target
        pytest.skip(f"the negative control needs an EAGLE draft for {sg.model}: pass "
                    "--specgate-draft-model")
    return chain


@pytest.mark.specgate_self_check
def test_negative_control_is_rejected(sg: SuiteContext, law_of: LawOf, setting: Setting,
                                      record_property: RecordProperty,
                                      request: pytest.FixtureRequest) -> None:
    """The same procedure must reject a subtly biased verifier under each setting, with
    power >= MIN_POWER. Requires: sampling (the control itself is the reference engine's
    mutant)."""
    law = law_of(setting)
    spec = control_spec(sg, request)
    n = samples(sg)
    trees: Trees = {}

    def grab_trees(handle: object) -> None:  # the control mutant records them
        trees.update(verified_draft_trees(handle))

    run = sample(mutant_backend(NEGATIVE_CONTROL), sg, spec, setting, law.prompt, grab_trees)
    result = check(law, run)
    _figures(record_property, "control_", law, run, result)
    _setting_figures(record_property, setting, law)

    # The control's exact law, from the trees it verified; its power at n by Monte Carlo.
    p_alt = speculative_law(law, trees, biased_bonus, spec.num_steps)
    power = power_at(law.probs, p_alt, n)
    record_property("control_power", power)
    record_property("control_power_trials", POWER_TRIALS)
    record_property("control_n_at_min_power", smallest_powerful_n(law.probs, p_alt, n))
    record_property("control_detectable_fraction",
                    smallest_detectable_fraction(law.probs, p_alt, n))
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
    fits = stats.gof_test(law.counts(run.outputs), np.append(p_alt, 0.0), NOMINAL_ALPHA)
    assert not fits.rejected, f"the control's derived law does not fit its run: {fits.summary()}"

    assert power >= MIN_POWER, (f"the tier is too weak under {setting.name}: it rejects the "
                                f"{NEGATIVE_CONTROL} control with power {power:.3f} < "
                                f"{MIN_POWER} at n={n}")
    assert result.rejected, (f"the {NEGATIVE_CONTROL} control was not rejected under "
                             f"{setting.name} (power {power:.3f}): {result.summary()}")


def verify_param_bug_powers(sg: SuiteContext, law_of: LawOf, bug: str
                            ) -> dict[str, float]:
    """Per setting of the profile, the power against an exact verifier that samples from the
    distribution under ``VERIFY_PARAM_BUGS[bug]``'s params (its law needs no run: see the
    module doc)."""
    powers = {}
    for setting in settings_for(sg.profile.name):
        law = law_of(setting)
        wrong = VERIFY_PARAM_BUGS[bug](setting.params(0))
        p_alt = verify_misapplied_law(
            law, lambda ids, wrong=wrong: sg.oracle.next_token_probs(ids, wrong))
        powers[setting.name] = power_at(law.probs_with_outside, p_alt, samples(sg))
    return powers


@pytest.mark.specgate_self_check
@pytest.mark.parametrize("bug", sorted(VERIFY_PARAM_BUGS))
def test_verify_param_bugs_have_power(sg: SuiteContext, law_of: LawOf, bug: str,
                                      record_property: RecordProperty) -> None:
    """Some setting catches each verify-path parameter bug of the bug zoo with power
    >= MIN_POWER. Requires: sampling."""
    powers = verify_param_bug_powers(sg, law_of, bug)
    for name, power in powers.items():
        record_property(f"power_{name}", power)
    # Some setting rejects at least as often as the best one alone (no independence assumed:
    # the settings' runs share their seeds).
    best = max(powers.values())
    record_property("power_best_setting", best)
    assert best >= MIN_POWER, (
        f"no setting catches {bug} reliably: best power {best:.3f} < {MIN_POWER} "
        f"(per setting: {powers})")
