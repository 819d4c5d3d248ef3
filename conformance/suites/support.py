"""Helpers shared by the suite's tiers: open a backend, run request mixes, compare outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

import pytest

from conformance.checks.calibration import near_tie_allowance
from conformance.checks.oracle import Divergence
from conformance.contract import SamplingParams, SpecConfig, effective_page_size
from conformance.plan.requests import (
    BOUNDARY_LEAD,
    context_lengths,
    context_limit,
    requests_across,
)
from conformance.plan.requests import greedy as greedy  # the tiers' spelling: support.greedy
from conformance.plan.specs import config_id
from conformance.repro.driver import Driver, Outcome, backend_call, step_budget
from conformance.run.context import SuiteContext, context
from conformance.run.pressure import widest_config
from refengine.data import fixture_names

# Page size 4 only where there are pages to size: backends that claim a paged pool
# (memory_view); any other backend runs the page-size-1 case once. Each is asked rounded up
# to the backend's page_multiple (page_for).
PAGE_SIZES = [1, pytest.param(4, marks=pytest.mark.specgate_requires("memory_view"))]

LONG_PREFILL_CHUNK = 96  # max_prefill_tokens for long requests: some chunk straddles each boundary

KEY_WIDTH_PAST = 4  # tokens a graphed check's request decodes past a boundary
GRAPH_CHECK_EXECUTOR = "replay"  # no compile time, and the same key selection as compiled


def parametrize_context_boundaries(metafunc: pytest.Metafunc, reach_limit: bool = False
                                   ) -> None:
    """For a suite module's ``pytest_generate_tests``: one case per context length of the
    profile (``boundary`` argument) the model can reach (``context_lengths``: ``reach_limit``,
    a case at the limit whatever the profile's lengths)."""
    if "boundary" in metafunc.fixturenames:
        sg = context(metafunc.config)
        lengths = context_lengths(sg.model, sg.profile.context_boundaries, reach_limit)
        metafunc.parametrize("boundary", lengths, ids=[f"ctx{n}" for n in lengths])


def long_context_requests(sg: SuiteContext, boundary: int
                          ) -> dict[str, tuple[list[int], SamplingParams]]:
    """``requests_across(sg.model, boundary)``: the suite modules' spelling."""
    return requests_across(sg.model, boundary)


def key_width_requests(sg: SuiteContext) -> dict[str, tuple[list[int], SamplingParams]]:
    """For each of the profile's context boundaries below the model's context limit (powers of
    two, where graph runners commonly switch key widths), the prompt of
    ``long_context_requests`` that decodes (speculates) across it, asking only a few tokens
    past it: a graphed step then runs on either side of the boundary."""
    limit = context_limit(sg.model)
    return {rid: (prompt, replace(params, max_new_tokens=BOUNDARY_LEAD + KEY_WIDTH_PAST))
            for n in sg.profile.context_boundaries if n < limit
            for rid, (prompt, params) in long_context_requests(sg, n).items()
            if rid.startswith("decode-across")}


def with_graph_runner(sg: SuiteContext) -> SuiteContext:
    """``sg`` opening the backend with its graph runner on (``GRAPH_CHECK_EXECUTOR``), for the
    check a tier runs graphed in a run without ``--graphs``. Not applicable (skipped, with the
    reason) when the run is graphed already: every check of the tier replays then."""
    if sg.graph_executor is not None:
        pytest.skip(f"not applicable: this run opens every check with the graph runner on "
                    f"(--graphs {sg.graph_executor})")
    return sg.with_executor(GRAPH_CHECK_EXECUTOR)


def assert_length_limited(sg: SuiteContext, outcomes: dict[str, Outcome],
                          requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    """Every request ends by length: at ``max_new_tokens``, or sooner at the context limit."""
    limit = context_limit(sg.model)
    for rid, (prompt, params) in requests.items():
        got = outcomes[rid]
        room = min(params.max_new_tokens, limit - len(prompt))
        assert (got.reason, len(got.output_ids)) == ("length", room), (
            f"{rid} ({len(prompt)}-token prompt, context limit {limit}): ended by "
            f"{got.reason!r} after {len(got.output_ids)} tokens, expected 'length' after {room}")


def model_property(sg: SuiteContext, holds: bool, what: str) -> None:
    """A check's precondition that is a property of the model and its prompt set, not of the
    backend (e.g. "the prompt's greedy output has four distinct early tokens"). On a bundled
    fixture it must hold: the check was designed on it, and a silently shrunk check would be a
    pass that proves less. Under another model (``--model DIR``) the check does not apply."""
    if holds:
        return
    assert sg.model not in fixture_names(), f"precondition on the bundled model {sg.model}: {what}"
    pytest.skip(f"not applicable with model {sg.model}: {what}")


def parametrize_spec_configs(
        metafunc: pytest.Metafunc,
        narrow: Callable[[SuiteContext], tuple[SpecConfig | None, ...]] | None = None) -> None:
    """For a suite module's ``pytest_generate_tests``: one case per configuration of the spec
    being certified (``spec_config`` argument), or per configuration ``narrow`` picks."""
    if "spec_config" in metafunc.fixturenames:
        sg = context(metafunc.config)
        configs = sg.spec.configs if narrow is None else narrow(sg)
        metafunc.parametrize("spec_config", configs, ids=[config_id(c) for c in configs])


def pressure_configs(sg: SuiteContext) -> tuple[SpecConfig | None, ...]:
    """The configurations a check that puts the KV pool under pressure opens: every one of the
    spec, or under a profile that says so (the gate) only the one with the largest per-step KV
    need (``conformance.run.pressure.step_kv_need``)."""
    if sg.profile.pressure_configs == "widest":
        return (widest_config(sg.spec.configs),)
    return sg.spec.configs


def page_for(sg: SuiteContext, asked: int) -> int:
    """The page size a check written for ``asked`` runs at on the backend under test
    (``effective_page_size``: a multiple of its ``page_multiple``); where that differs, the
    check's ``page_size_run`` figure says so (report.md, Figures)."""
    page = effective_page_size(sg.caps, asked)
    if page != asked:
        sg.extend_property("page_size_run", [f"{page} (asked {asked})"])
    return page


@contextmanager
def open_driver(sg: SuiteContext, spec: SpecConfig | Literal["first"] | None = "first",
                **limits: int) -> Iterator[Driver]:
    """A fresh engine instance of the backend under test. ``spec``: a configuration of the
    spec being certified; by default its first one."""
    chosen = sg.spec.configs[0] if spec == "first" else spec
    if "page_size" in limits:
        limits["page_size"] = page_for(sg, limits["page_size"])
    config = sg.open_config(chosen, **limits)
    with backend_call("backend.open()"):
        handle = sg.backend.open(config)
    try:
        driver = Driver(handle, sg.caps, overlap=chosen is not None and chosen.overlap,
                        config=config)
        sg.recorded.drivers.append(driver)  # a failing check leaves their repro
        yield driver
    finally:
        with backend_call("handle.close()"):
            handle.close()


def run_all(driver: Driver, requests: dict[str, tuple[list[int], SamplingParams]]
            ) -> dict[str, Outcome]:
    for rid, (prompt, params) in requests.items():
        driver.submit(rid, prompt, params)
    return driver.run(step_budget(list(requests.values())))


def near_tie_epsilon(sg: SuiteContext) -> float:
    """The near-tie bound for the backend's declared precision (``near_tie_allowance``: a
    reduced precision's is calibrated on the reference itself, once per process)."""
    return near_tie_allowance(sg.model, sg.caps.precision, sg.profile)


def _divergences(sg: SuiteContext, outputs: Mapping[str, Sequence[int]],
                 requests: dict[str, tuple[list[int], SamplingParams]]
                 ) -> dict[str, Divergence]:
    """Each request whose output differs from the reference's greedy output, with its first
    divergence; those at a near-tie for the backend's declared precision (``near_tie_epsilon``,
    asked only when something differs) are listed in the check's ``near_ties`` property as
    ``<rid>@<output index> margin=<reference top-2 margin>``. How many tokens were compared
    equal before each comparison ended goes to the ``tokens_compared`` property:
    ``<compared>/<the reference's tokens>, fewest <compared>/<its tokens>`` per call."""
    found = {rid: sg.oracle.divergence(tuple(prompt), params, list(outputs[rid]), 0.0)
             for rid, (prompt, params) in requests.items()}
    differ = {rid: d for rid, d in found.items() if d is not None}
    if differ:
        epsilon = near_tie_epsilon(sg)
        differ = {rid: replace(d, epsilon=epsilon) for rid, d in differ.items()}
    ties = [f"{rid}@{d.index} margin={d.margin:.3g}" for rid, d in differ.items() if d.near_tie]
    if ties:
        sg.extend_property("near_ties", ties)
    counts = [(differ[rid].index if rid in differ else len(outputs[rid]),
               len(sg.oracle.greedy(tuple(prompt), params)))
              for rid, (prompt, params) in requests.items()]
    if counts:
        fewest = min(counts, key=lambda c: (c[0] / max(c[1], 1), c[0]))
        sg.extend_property("tokens_compared", [
            f"{sum(c for c, _ in counts)}/{sum(t for _, t in counts)}, "
            f"fewest {fewest[0]}/{fewest[1]}"])
    return differ


def near_tied(sg: SuiteContext, outputs: Mapping[str, Sequence[int]],
              requests: dict[str, tuple[list[int], SamplingParams]]) -> set[str]:
    """The requests whose output first differs from the reference's greedy output at a
    near-tie (listed as ``assert_matches_oracle`` lists them): past it the continuation
    legitimately differs, so a check that expects exact tokens (a stop, an abort's prefix)
    has nothing of that request to compare. Any other difference is left to the caller."""
    return {rid for rid, d in _divergences(sg, outputs, requests).items() if d.near_tie}


def assert_matches_oracle(sg: SuiteContext, outcomes: dict[str, Outcome],
                          requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    """Every output equals the reference's greedy output, token for token, up to its first
    difference; a difference at a near-tie (``near_tied``) ends that request's comparison (its
    continuation legitimately differs); any other difference fails."""
    found = _divergences(sg, {rid: outcomes[rid].output_ids for rid in requests}, requests)
    bad = [f"{rid}: {d.describe()}" for rid, d in found.items() if not d.near_tie]
    assert not bad, f"{len(bad)}/{len(requests)} outputs differ from the reference: {bad[:5]}"
