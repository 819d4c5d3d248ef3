"""Tier memory: M1-M5 and the retraction rules R1-R2 (``conformance.checks.retraction``) after
every step under a load mix with staggered arrivals, aborts and a KV pool small enough to put
the backend under pressure (it retracts, or it queues requests the pool cannot hold:
``conformance.run.pressure``), with short prompts, with contexts past the
profile's boundaries and, in every profile, with a request that runs to the model's context
limit (a limit up to ``requests.REACH_LIMIT_MAX``); outputs stay exactly the reference's
(near-ties aside, as in the lossless tier). Each check opens every configuration of the spec,
or under the gate the one with the largest per-step KV need.

Every check requires stepwise and memory_view (and the spec's algorithm); further requirements
are in each check's docstring.
"""

from __future__ import annotations

import random

import pytest

from conformance.contract import SamplingParams, SpecConfig
from conformance.plan.requests import context_limit
from conformance.repro.driver import Outcome
from conformance.run.context import SuiteContext
from conformance.run.pressure import PressureWitness, step_kv_need
from conformance.suites.support import (
    LONG_PREFILL_CHUNK,
    PAGE_SIZES,
    assert_length_limited,
    assert_matches_oracle,
    greedy,
    key_width_requests,
    long_context_requests,
    open_driver,
    page_for,
    parametrize_context_boundaries,
    parametrize_spec_configs,
    pressure_configs,
    with_graph_runner,
)

pytestmark = [pytest.mark.specgate_tier("memory"),
              pytest.mark.specgate_requires("stepwise", "memory_view")]

WAVE = 3  # requests submitted every other step

Requests = dict[str, tuple[list[int], SamplingParams]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_spec_configs(metafunc, pressure_configs)
    parametrize_context_boundaries(metafunc, reach_limit=True)


def _short_mix(sg: SuiteContext, rng: random.Random) -> Requests:
    cases = list(sg.prompts) * 2
    rng.shuffle(cases)
    return {f"{c.id}-{i}": (list(c.ids), greedy(8 + rng.randrange(sg.profile.max_new_tokens)))
            for i, c in enumerate(cases)}


def _load_mix(sg: SuiteContext, spec: SpecConfig | None, requests: Requests, rng: random.Random,
              abort_fraction: float, page_size: int, record_property, **limits: int
              ) -> dict[str, Outcome]:
    """Run ``requests`` in waves under ``spec`` in a pool that puts them under pressure, some
    aborted; the outputs of those not aborted must be the reference's. The pool is sized in
    pages of the size the backend runs (``page_for``). Returns the outcomes."""
    page_size = page_for(sg, page_size)
    limit = context_limit(sg.model)
    need = {rid: min(len(p) + s.max_new_tokens, limit) for rid, (p, s) in requests.items()}
    # Room for the longest request alone, with head-room for the slots a speculative step
    # holds past its sequence (the verify block, the draft scratch or an overlap reservation:
    # step_kv_need), else a backend rightly refuses it as never fitting; and small enough
    # overall to put the backend under pressure.
    pool = max(max(need.values()) + 2 * step_kv_need(spec) + 2 * page_size,
               int(0.3 * sum(need.values())))
    pool = -(-pool // page_size) * page_size
    doomed = {rid for rid in requests if rng.random() < abort_fraction}
    witness = PressureWitness(need)
    with open_driver(sg, spec, kv_pool_tokens=pool, page_size=page_size, **limits) as driver:
        pending = list(requests.items())
        while pending or driver.live:
            if driver.steps % 2 == 0:
                for rid, (prompt, params) in pending[:WAVE]:
                    driver.submit(rid, prompt, params)
                pending = pending[WAVE:]
            for rid in sorted(doomed & driver.live):
                if rng.random() < 0.2:
                    driver.abort(rid)
                    witness.aborted.add(rid)
            driver.step()
            assert driver.view is not None  # the tier requires memory_view
            witness.observe(driver.view, driver.live)
            assert driver.steps < 20_000, "no progress under memory pressure"
        record_property("retractions", driver.retractions)
        record_property("queued_steps", witness.queued_steps)
        record_property("steps", driver.steps)
        assert witness.applied(driver.retractions), (
            f"a {pool}-token pool for {len(requests)} requests needing {sum(need.values())} "
            f"tokens forced no retraction in {driver.steps} steps, and no request waited that "
            "the free pool could not hold: nothing was checked under pressure")
    # a finish 'abort' is one the check asked for (the driver fails any other)
    survivors = {rid: r for rid, r in requests.items()
                 if driver.outcomes[rid].reason != "abort"}
    assert_matches_oracle(sg, driver.outcomes, survivors)
    return driver.outcomes


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_invariants_under_pressure(sg: SuiteContext, spec_config: SpecConfig | None,
                                   page_size: int, record_property) -> None:
    """Requires nothing more."""
    rng = random.Random(page_size)
    _load_mix(sg, spec_config, _short_mix(sg, rng), rng, abort_fraction=0.0,
              page_size=page_size, record_property=record_property)


@pytest.mark.specgate_requires("abort")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_invariants_with_aborts(sg: SuiteContext, spec_config: SpecConfig | None,
                               page_size: int, record_property) -> None:
    """Requires: abort."""
    rng = random.Random(100 + page_size)
    _load_mix(sg, spec_config, _short_mix(sg, rng), rng, abort_fraction=0.3,
              page_size=page_size, record_property=record_property)


def test_invariants_past_context_boundary(sg: SuiteContext, spec_config: SpecConfig | None,
                                          boundary: int, record_property) -> None:
    """The long requests of the lossless tier (across ``boundary`` while decoding and inside a
    chunked prompt, or up to the context limit, where it must end by length) with a few short
    ones, in pages of 4, in a pool that puts them under pressure (retracted, they re-prefill
    across the boundary). Requires nothing more."""
    rng = random.Random(boundary)
    short = list(_short_mix(sg, rng).items())[:4]
    requests = {**long_context_requests(sg, boundary), **dict(short)}
    outcomes = _load_mix(sg, spec_config, requests, rng, abort_fraction=0.0, page_size=4,
                         record_property=record_property, max_prefill_tokens=LONG_PREFILL_CHUNK)
    assert_length_limited(sg, outcomes, requests)  # ignore_eos: every request ends by length


@pytest.mark.specgate_requires("graph_runner")
def test_invariants_with_graph_runner_across_key_widths(sg: SuiteContext,
                                                         record_property) -> None:
    """Once with the backend's graph runner on (executor ``replay``) in a run without
    ``--graphs``: requests that decode across key widths (as the lossless tier's graphed
    check) with a few short ones, in pages of 4, in a pool that forces them to retract and
    re-prefill, so graphed steps run either side of a width under pressure. Not applicable
    under ``--graphs`` (every check replays then). Requires: graph_runner."""
    graphed = with_graph_runner(sg)
    rng = random.Random(7)
    short = list(_short_mix(sg, rng).items())[:4]
    _load_mix(graphed, sg.spec.configs[0], {**key_width_requests(sg), **dict(short)}, rng,
              abort_fraction=0.0, page_size=4, record_property=record_property)
