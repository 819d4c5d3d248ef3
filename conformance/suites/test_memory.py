"""Tier memory: M1-M5 after every step under a load mix with staggered arrivals, aborts and a
KV pool small enough to force retraction; outputs stay exactly the reference's."""

from __future__ import annotations

import random

import pytest

from conformance.plugin import SuiteContext
from conformance.suites.support import assert_matches_oracle, greedy, open_driver

pytestmark = [pytest.mark.specgate_tier("memory"),
              pytest.mark.specgate_requires("stepwise", "memory_view")]

WAVE = 3  # requests submitted every other step


def _load_mix(sg: SuiteContext, seed: int, abort_fraction: float, page_size: int,
              record_property) -> None:
    rng = random.Random(seed)
    cases = list(sg.prompts) * 2
    rng.shuffle(cases)
    requests = {f"{c.id}-{i}": (list(c.ids), greedy(8 + rng.randrange(sg.profile.max_new_tokens)))
                for i, c in enumerate(cases)}
    need = [len(p) + s.max_new_tokens for p, s in requests.values()]
    pool = max(max(need) + 2 * page_size, int(0.3 * sum(need)))  # forces retraction
    pool = -(-pool // page_size) * page_size
    doomed = {rid for rid in requests if rng.random() < abort_fraction}
    with open_driver(sg, kv_pool_tokens=pool, page_size=page_size) as driver:
        pending = list(requests.items())
        while pending or driver.live:
            if driver.steps % 2 == 0:
                for rid, (prompt, params) in pending[:WAVE]:
                    driver.submit(rid, prompt, params)
                pending = pending[WAVE:]
            for rid in sorted(doomed & driver.live):
                if rng.random() < 0.2:
                    driver.abort(rid)
            driver.step()
            assert driver.steps < 20_000, "no progress under memory pressure"
        record_property("retractions", driver.retractions)
        record_property("steps", driver.steps)
        assert driver.retractions > 0, (
            f"a {pool}-token pool for {len(requests)} requests needing {sum(need)} tokens "
            f"forced no retraction in {driver.steps} steps: nothing was checked under pressure")
    survivors = {rid: r for rid, r in requests.items()
                 if driver.outcomes[rid].reason != "abort"}
    aborted = [rid for rid, o in driver.outcomes.items() if o.reason == "abort"]
    assert not set(aborted) - doomed, f"requests finished as aborted unasked: {aborted}"
    assert_matches_oracle(sg, driver.outcomes, survivors)


@pytest.mark.parametrize("page_size", [1, 4])
def test_invariants_under_pressure(sg: SuiteContext, page_size: int, record_property) -> None:
    _load_mix(sg, seed=page_size, abort_fraction=0.0, page_size=page_size,
              record_property=record_property)


@pytest.mark.specgate_requires("abort")
@pytest.mark.parametrize("page_size", [1, 4])
def test_invariants_with_aborts(sg: SuiteContext, page_size: int, record_property) -> None:
    _load_mix(sg, seed=100 + page_size, abort_fraction=0.3, page_size=page_size,
              record_property=record_property)
