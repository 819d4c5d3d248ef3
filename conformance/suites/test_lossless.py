"""Tier lossless: the backend's greedy output equals the reference engine's plain greedy
output, token for token, for every batch composition and page size."""

from __future__ import annotations

import pytest

from conformance.plugin import SuiteContext
from conformance.suites.support import assert_matches_oracle, greedy, open_driver, run_all

pytestmark = pytest.mark.specgate_tier("lossless")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arrival", ["all_at_once", "one_at_a_time"])
def test_greedy_matches_reference(sg: SuiteContext, page_size: int, arrival: str) -> None:
    params = greedy(sg.profile.max_new_tokens)
    requests = {c.id: (list(c.ids), params) for c in sg.prompts}
    with open_driver(sg, page_size=page_size) as driver:
        if arrival == "all_at_once":
            outcomes = run_all(driver, requests)
        else:
            outcomes = {}
            for rid, req in requests.items():
                outcomes.update(run_all(driver, {rid: req}))
    assert_matches_oracle(sg, outcomes, requests)
    assert all(o.reason == "length" for o in outcomes.values())


@pytest.mark.parametrize("batch_size", [2, 8])
def test_batch_of_mixed_lengths(sg: SuiteContext, batch_size: int) -> None:
    """Short and long prompts together, with different output lengths per request."""
    cases = sorted(sg.prompts, key=lambda c: len(c.ids))
    picked = [cases[i * (len(cases) - 1) // max(1, batch_size - 1)] for i in range(batch_size)]
    requests = {f"{c.id}-{i}": (list(c.ids), greedy(4 + 7 * i % sg.profile.max_new_tokens))
                for i, c in enumerate(picked)}
    with open_driver(sg) as driver:
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)
