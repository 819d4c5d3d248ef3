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

from collections.abc import Callable
from dataclasses import replace

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
from conformance.contract import OpenConfig, SpecConfig
from conformance.plan.specs import SPECS
from conformance.run.context import SuiteContext
from conformance.run.options import plan_of
from conformance.suites.support_distribution import (
    CANDIDATE_PROMPTS,
    MAX_CELLS,
    MIN_POWER,
    NOMINAL_ALPHA,
    POWER_TRIALS,
    TOKENS,
    RecordProperty,
    Setting,
    check,
    power_at,
    record_figures,
    record_setting_figures,
    sample,
    samples,
    settings_for,
    smallest_detectable_fraction,
    smallest_powerful_n,
    worst_cells,
)

# Both checks submit every request, then only step to the end (nothing acts between steps):
# run-to-completion backends are certified too.
pytestmark = [pytest.mark.specgate_tier("distribution"),
              pytest.mark.specgate_requires("sampling")]

NEGATIVE_CONTROL = "biased_verify_sampler"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "setting" in metafunc.fixturenames:
        chosen = settings_for(plan_of(metafunc.config).profile)
        metafunc.parametrize("setting", chosen, ids=lambda s: s.name)


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


def test_sampled_tokens_follow_target_distribution(sg: SuiteContext, law_of: LawOf,
                                                   setting: Setting,
                                                   record_property: RecordProperty) -> None:
    """The backend's first three sampled tokens follow the target's exact joint law under
    each sampling setting. Requires: sampling."""
    law = law_of(setting)
    run = sample(sg.backend, sg, sg.spec.configs[0], setting, law.prompt)
    result = check(law, run)
    record_figures(record_property, "", law, run, result)
    record_setting_figures(record_property, setting, law)
    assert not result.rejected, (
        f"emitted tokens do not follow the target distribution under {setting.name}: "
        f"{result.summary()}; worst cells: {worst_cells(law, run)}")


# --- the negative controls ----------------------------------------------------------------

def control_spec(sg: SuiteContext) -> SpecConfig:
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
    draft = sg.draft_model
    if draft:
        return replace(chain, draft_model=draft)
    if sg.model != OpenConfig().model:  # the bundled head was distilled from this target
        pytest.skip(f"the negative control needs an EAGLE draft for {sg.model}: pass "
                    "--specgate-draft-model")
    return chain


@pytest.mark.specgate_self_check
def test_negative_control_is_rejected(sg: SuiteContext, law_of: LawOf, setting: Setting,
                                      record_property: RecordProperty) -> None:
    """The same procedure must reject a subtly biased verifier under each setting, with
    power >= MIN_POWER. Requires: sampling (the control itself is the reference engine's
    mutant)."""
    law = law_of(setting)
    spec = control_spec(sg)
    n = samples(sg)
    trees: Trees = {}

    def grab_trees(handle: object) -> None:  # the control mutant records them
        trees.update(verified_draft_trees(handle))

    run = sample(mutant_backend(NEGATIVE_CONTROL), sg, spec, setting, law.prompt, grab_trees)
    result = check(law, run)
    record_figures(record_property, "control_", law, run, result)
    record_setting_figures(record_property, setting, law)

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
