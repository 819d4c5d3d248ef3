"""Tier lossless: the backend's greedy output equals the reference engine's plain greedy
output, token for token — for every configuration of the spec, page size, batch composition,
retraction schedule and context length past the profile's boundaries (512, 1024, 2048), and, in
every profile, up to the model's context limit (a limit up to ``requests.REACH_LIMIT_MAX``): the
one check near the limit that every backend runs, whatever it claims.

A first difference where the reference's own top-2 logit margin is below the near-tie bound
of the backend's declared precision (``Capabilities.precision``; ``support.near_tie_epsilon``:
calibrated on the reference for bfloat16 and float16) is a near-tie: listed in the check's
``near_ties`` property, not a failure, and nothing after it is compared for that request (its
continuation legitimately differs). Any other difference fails. How many tokens each
comparison covered is its ``tokens_compared`` figure.

Every check also requires the spec's algorithm (``algorithm:<name>``); further requirements
are in each check's docstring.
"""

from __future__ import annotations

import pytest

from conformance.checks.ngram_drafts import determined_steps, violations
from conformance.contract import SamplingParams, SpecConfig
from conformance.plan.shapes import drawn_configs
from conformance.plan.specs import config_id
from conformance.run.context import SuiteContext, context
from conformance.suites.support import (
    LONG_PREFILL_CHUNK,
    PAGE_SIZES,
    assert_length_limited,
    assert_matches_oracle,
    greedy,
    key_width_requests,
    long_context_requests,
    model_property,
    open_driver,
    parametrize_context_boundaries,
    parametrize_spec_configs,
    run_all,
    with_graph_runner,
)

pytestmark = pytest.mark.specgate_tier("lossless")
BATCH = 16


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_spec_configs(metafunc)
    parametrize_context_boundaries(metafunc, reach_limit=True)
    if "drawn_config" in metafunc.fixturenames:
        sg = context(metafunc.config)
        drawn = drawn_configs(sg.spec, sg.profile.drawn_shapes) or (None,)
        metafunc.parametrize("drawn_config", drawn, ids=[config_id(c) for c in drawn])


def _batch(sg: SuiteContext, size: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """``size`` requests cycling through the prompt set: mixed prompt lengths."""
    cases = [sg.prompts[i % len(sg.prompts)] for i in range(size)]
    return {f"{c.id}-{i}": (list(c.ids), greedy(sg.profile.max_new_tokens))
            for i, c in enumerate(cases)}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("arrival", ["batch", "one_at_a_time"])
def test_greedy_matches_reference(sg: SuiteContext, spec_config: SpecConfig | None,
                                  page_size: int, arrival: str, record_property) -> None:
    """Requires: page size 4: memory_view."""
    requests = _batch(sg, BATCH if arrival == "batch" else len(sg.prompts))
    with open_driver(sg, spec_config, page_size=page_size) as driver:
        if arrival == "batch":
            outcomes = run_all(driver, requests)
        else:
            outcomes = {}
            for rid, req in requests.items():
                outcomes.update(run_all(driver, {rid: req}))
    assert_matches_oracle(sg, outcomes, requests)
    assert_length_limited(sg, outcomes, requests)  # ignore_eos: every request ends by length
    lens = [n for o in outcomes.values() for n in o.accept_lens]
    if lens:
        record_property("tau", round(sum(lens) / len(lens), 3))


@pytest.mark.parametrize("batch_size", [2, 8])
def test_batch_of_mixed_lengths(sg: SuiteContext, spec_config: SpecConfig | None,
                                batch_size: int) -> None:
    """Short and long prompts together, with different output lengths per request.
    Requires nothing more."""
    cases = sorted(sg.prompts, key=lambda c: len(c.ids))
    picked = [cases[i * (len(cases) - 1) // max(1, batch_size - 1)] for i in range(batch_size)]
    requests = {f"{c.id}-{i}": (list(c.ids), greedy(4 + 7 * i % sg.profile.max_new_tokens))
                for i, c in enumerate(picked)}
    with open_driver(sg, spec_config) as driver:
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)


@pytest.mark.specgate_requires("forced_retract")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_forced_retraction_every_3_steps(sg: SuiteContext, spec_config: SpecConfig | None,
                                         page_size: int, record_property) -> None:
    """Retract the middle request every 3 decode steps: resumed requests continue exactly.
    Requires: forced_retract; page size 4: memory_view."""
    requests = _batch(sg, BATCH)
    with open_driver(sg, spec_config, page_size=page_size, retract_every=3) as driver:
        outcomes = run_all(driver, requests)
        record_property("retractions", driver.retractions)
        assert driver.retractions > 0, "the forced-retract hook never fired"
    assert_matches_oracle(sg, outcomes, requests)


# Every 8 decode steps: a retraction lands near the boundary, and each re-prefills ~500 tokens.
@pytest.mark.parametrize("retract_every", [0, pytest.param(8, marks=pytest.mark.specgate_requires(
    "forced_retract"))], ids=["no-retract", "retract"])
def test_past_context_boundary(sg: SuiteContext, spec_config: SpecConfig | None, boundary: int,
                               retract_every: int, record_property) -> None:
    """Contexts crossing ``boundary`` tokens (where engines size internal buffers): one request
    speculates across it, one prefills across it in chunks; with retraction both re-prefill
    across it. At the model's context limit (in every profile), a request must end there by
    length. Requires: retract: forced_retract."""
    requests = long_context_requests(sg, boundary)
    with open_driver(sg, spec_config, max_prefill_tokens=LONG_PREFILL_CHUNK,
                     retract_every=retract_every) as driver:
        outcomes = run_all(driver, requests)
        record_property("retractions", driver.retractions)
    assert_matches_oracle(sg, outcomes, requests)
    assert_length_limited(sg, outcomes, requests)
    # after the outputs: a request that ends too soon is that failure, not a hook that never fired
    assert not retract_every or driver.retractions > 0, "the forced-retract hook never fired"


@pytest.mark.specgate_requires("graph_runner")
def test_graph_runner_across_key_widths(sg: SuiteContext) -> None:
    """Once with the backend's graph runner on (executor ``replay``) in a run without
    ``--graphs``: requests whose contexts cross key widths while decoding, with short ones in
    the same batch, so a graph-only bug in key selection (a width too narrow for a request
    drops its keys past the width) is an output difference. Not applicable under
    ``--graphs`` (every check replays then). Requires: graph_runner."""
    graphed = with_graph_runner(sg)
    requests = {**_batch(sg, 4), **key_width_requests(sg)}  # the longest arrive last
    with open_driver(graphed) as driver:
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)
    assert_length_limited(sg, outcomes, requests)


@pytest.mark.specgate_requires("acceptance_stats")
def test_ngram_steps_accept_what_every_lookup_proposes(sg: SuiteContext,
                                                        spec_config: SpecConfig | None,
                                                        record_property) -> None:
    """Prompt lookup: at every verify step whose first drafts every correct n-gram drafter
    agrees on (``conformance.checks.ngram_drafts``), each greedy request of the prompt set, in
    one batch, emits what a correct verify of those drafts emits. It reads only the backend's
    own outputs, so it holds whichever occurrence a lookup prefers (refengine's latest, vLLM's
    earliest), where the golden tier's traces cannot. Requires: the ngram algorithm (other
    specs: not applicable), acceptance_stats."""
    if spec_config is None or spec_config.algorithm != "ngram":
        pytest.skip("not applicable: checks n-gram (prompt lookup) speculation only")
    requests = {c.id: (list(c.ids), greedy(sg.profile.max_new_tokens)) for c in sg.prompts}
    with open_driver(sg, spec_config) as driver:
        outcomes = run_all(driver, requests)
    rules = {rid: determined_steps(prompt, outcomes[rid].output_ids, outcomes[rid].accept_lens,
                                   spec_config.num_steps)
             for rid, (prompt, _) in requests.items()}
    determined = sum(len(r) for r in rules.values())
    record_property("determined_steps",
                    f"{determined} of {sum(len(o.accept_lens) for o in outcomes.values())}")
    model_property(sg, determined > 0, "no determined step: no verify step of the prompt set "
                   "has drafts every prompt-lookup drafter agrees on")
    bad = [f"{rid}: {v.describe()}" for rid, r in rules.items()
           for v in violations(r, outcomes[rid].accept_lens)]
    assert not bad, (f"{len(bad)} of {determined} determined verify steps emitted what no "
                     f"correct verify of the drafts every prompt-lookup drafter proposes "
                     f"could: {bad[:5]}")


def test_drawn_shape_matches_reference(sg: SuiteContext, drawn_config: SpecConfig | None
                                       ) -> None:
    """A legal speculative shape of the spec's algorithm beyond its named configurations,
    drawn (``conformance.plan.shapes``: for a spec with trees a tree of N = S + 1 nodes, one of
    N = S·k and a chain first; the profile says how many): a batch's greedy outputs equal the
    reference's, so a rule keyed on a shape no named configuration has is seen. Requires
    nothing more; plain decoding: not applicable."""
    if drawn_config is None:
        pytest.skip("not applicable: plain decoding has no speculative shape to draw")
    requests = _batch(sg, BATCH)
    with open_driver(sg, drawn_config) as driver:
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)
    assert_length_limited(sg, outcomes, requests)
