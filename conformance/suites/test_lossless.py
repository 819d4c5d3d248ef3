"""Tier lossless: the backend's greedy output equals the reference engine's plain greedy
output, token for token — for every configuration of the spec, page size, batch composition
and retraction schedule. Near-ties are never loosened: the oracle runs in float32 too."""

from __future__ import annotations

import pytest

from conformance.adapter import SamplingParams, SpecConfig
from conformance.plugin import SuiteContext
from conformance.suites.support import (
    assert_matches_oracle,
    greedy,
    open_driver,
    parametrize_spec_configs,
    run_all,
)

pytestmark = pytest.mark.specgate_tier("lossless")
BATCH = 16


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_spec_configs(metafunc)


def _batch(sg: SuiteContext, size: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """``size`` requests cycling through the prompt set: mixed prompt lengths."""
    cases = [sg.prompts[i % len(sg.prompts)] for i in range(size)]
    return {f"{c.id}-{i}": (list(c.ids), greedy(sg.profile.max_new_tokens))
            for i, c in enumerate(cases)}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arrival", ["batch", "one_at_a_time"])
def test_greedy_matches_reference(sg: SuiteContext, spec_config: SpecConfig | None,
                                  page_size: int, arrival: str, record_property) -> None:
    requests = _batch(sg, BATCH if arrival == "batch" else len(sg.prompts))
    with open_driver(sg, spec_config, page_size=page_size) as driver:
        if arrival == "batch":
            outcomes = run_all(driver, requests)
        else:
            outcomes = {}
            for rid, req in requests.items():
                outcomes.update(run_all(driver, {rid: req}))
    assert_matches_oracle(sg, outcomes, requests)
    early = {rid: o.reason for rid, o in outcomes.items() if o.reason != "length"}
    assert not early, f"with ignore_eos every request must end by length, got {early}"
    lens = [n for o in outcomes.values() for n in o.accept_lens]
    if lens:
        record_property("tau", round(sum(lens) / len(lens), 3))


@pytest.mark.parametrize("batch_size", [2, 8])
def test_batch_of_mixed_lengths(sg: SuiteContext, spec_config: SpecConfig | None,
                                batch_size: int) -> None:
    """Short and long prompts together, with different output lengths per request."""
    cases = sorted(sg.prompts, key=lambda c: len(c.ids))
    picked = [cases[i * (len(cases) - 1) // max(1, batch_size - 1)] for i in range(batch_size)]
    requests = {f"{c.id}-{i}": (list(c.ids), greedy(4 + 7 * i % sg.profile.max_new_tokens))
                for i, c in enumerate(picked)}
    with open_driver(sg, spec_config) as driver:
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)


@pytest.mark.specgate_requires("forced_retract")
@pytest.mark.parametrize("page_size", [1, 4])
def test_forced_retraction_every_3_steps(sg: SuiteContext, spec_config: SpecConfig | None,
                                         page_size: int, record_property) -> None:
    """Retract the middle request every 3 decode steps: resumed requests continue exactly."""
    requests = _batch(sg, BATCH)
    with open_driver(sg, spec_config, page_size=page_size, retract_every=3) as driver:
        outcomes = run_all(driver, requests)
        record_property("retractions", driver.retractions)
        assert driver.retractions > 0, "the forced-retract hook never fired"
    assert_matches_oracle(sg, outcomes, requests)
