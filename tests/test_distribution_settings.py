"""The distribution tier's sampling settings have teeth: the bug zoo's verify-path parameter
bugs (``verify_ignores_top_p``, ``verify_temperature_misapplied``) emit tokens outside the
target's support under top-p, their exact law (``verify_misapplied_law``) fits their runs,
greedy output stays the reference's, and the tier itself fails them (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_plugin import run_suite

from conformance.backends.mutants import MUTANTS
from conformance.backends.mutants.sampling import VERIFY_PARAM_BUGS
from conformance.checks import stats
from conformance.checks.distribution import JointLaw, exact_law, verify_misapplied_law
from conformance.checks.oracle import ReferenceOracle
from conformance.plan.prompts import load_prompt_set
from conformance.plan.specs import SPECS
from conformance.suites.support_distribution import (
    ALPHA_PER_SETTING,
    SETTINGS,
    TOKENS,
    Setting,
    settings_for,
)
from refengine import Engine, EngineConfig, SamplingParams

pytest_plugins = ["pytester"]

TOP_P = next(s for s in SETTINGS if s.name == "top-p")
PROMPT = "small-003"  # the tier's choice for every setting on the gate profile's prompts
REQUESTS = 384


@pytest.fixture(scope="module")
def oracle() -> ReferenceOracle:
    return ReferenceOracle("tiny-code")


@pytest.fixture(scope="module")
def law(oracle: ReferenceOracle) -> JointLaw:
    case = next(c for c in load_prompt_set("small") if c.id == PROMPT)
    params = TOP_P.params(0)
    return exact_law(lambda ids: oracle.next_token_probs(ids, params), case.id, case.ids, TOKENS)


def outputs(engine_class: type[Engine], law: JointLaw, params: list[SamplingParams]
            ) -> list[list[int]]:
    config = SPECS["eagle"].configs[0]
    engine = engine_class(EngineConfig(model="tiny-code", spec=config, kv_pool_tokens=65536,
                                       max_running_requests=128))
    return [o.output_ids for o in engine.generate([list(law.prompt)] * len(params), params)]


def seeded(setting: Setting) -> list[SamplingParams]:
    return [setting.params(seed) for seed in range(REQUESTS)]


@pytest.mark.parametrize("bug", sorted(VERIFY_PARAM_BUGS))
def test_verify_param_bug_leaves_the_support_and_follows_its_derived_law(
        bug: str, law: JointLaw, oracle: ReferenceOracle) -> None:
    runs = outputs(MUTANTS[bug].engine_class, law, seeded(TOP_P))
    counts = law.counts(runs)
    assert counts[-1] > 0, "no draw outside the target's nucleus"
    assert stats.gof_test(counts, law.probs_with_outside, ALPHA_PER_SETTING).rejected

    wrong = VERIFY_PARAM_BUGS[bug](TOP_P.params(0))
    derived = verify_misapplied_law(law, lambda ids: oracle.next_token_probs(ids, wrong))
    assert derived.sum() == pytest.approx(1.0, abs=1e-9)
    fits = stats.gof_test(counts, derived, ALPHA_PER_SETTING)
    assert not fits.rejected, f"the derived law does not fit the mutant's run: {fits.summary()}"


def test_the_reference_engine_stays_in_the_support(law: JointLaw) -> None:
    counts = law.counts(outputs(Engine, law, seeded(TOP_P)))
    assert counts[-1] == 0
    assert not stats.gof_test(counts, law.probs_with_outside, ALPHA_PER_SETTING).rejected


@pytest.mark.parametrize("bug", sorted(VERIFY_PARAM_BUGS))
def test_verify_param_bug_keeps_greedy_output(bug: str, law: JointLaw) -> None:
    greedy = [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)]
    assert outputs(MUTANTS[bug].engine_class, law, greedy) == outputs(Engine, law, greedy)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(VERIFY_PARAM_BUGS))
def test_the_tier_kills_verify_param_bug(pytester: pytest.Pytester, bug: str) -> None:
    """The tier's own check fails the mutant under the top-p settings (``specgate mutants``
    runs the same)."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, f"mutant:{bug}", Path("tiny-code"), "--specgate-spec",
                             "eagle", "-k", "test_sampled_tokens_follow_target_distribution")
    assert res.ret == pytest.ExitCode.TESTS_FAILED, res.stdout.str()[-2000:]
    failed = {c["nodeid"] for c in results["checks"] if c["outcome"] == "failed"}
    assert any("top-p]" in name for name in failed), json.dumps(results["checks"])[:2000]


def test_the_false_alarm_budget_is_split_over_the_settings() -> None:
    assert len({s.name for s in SETTINGS}) == len(SETTINGS) >= 4
    assert np.isclose(ALPHA_PER_SETTING * len(SETTINGS), stats.ALPHA)


def test_the_gate_settings_cover_both_temperatures_top_k_and_top_p() -> None:
    """The gate runs a subset (the full profile every setting): between them its settings
    still sample below and above temperature 1, under top-k and under top-p."""
    gate = settings_for("gate")
    assert settings_for("full") == SETTINGS and 0 < len(gate) < len(SETTINGS)
    assert min(s.temperature for s in gate) < 1 < max(s.temperature for s in gate)
    assert any(s.top_k > 0 for s in gate) and any(s.top_p < 1 for s in gate)
    assert any(s.top_k > 0 and s.top_p < 1 for s in gate)
