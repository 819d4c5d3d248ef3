"""Tier graph (white-box, through ``handle.graph_probe()``): the graph runner's padding.

A graph runner replays decode and verify forwards (and whatever else the backend captures) on
static buffers padded up to a bucket. Its bugs do not show in a normal run's tokens: padded
rows that read or write a real request's KV, a tail left over from an earlier, bigger batch,
buffers that move between replays, outputs in memory the next replay overwrites. The probe
runs synthetic cases eagerly and through the graph runner; for every kind it replays and every
raw batch size 1..max_batch (the padded sizes are the point), this tier checks (the statements
live in ``conformance/checks/graph.py``):

- padded rows hold the padding policy's values after a bigger batch filled every static row;
- graph == eager (integers exactly, floats within the probe's tolerance), both from the same
  state, and neither changes state outside the real rows' own KV (and the dummy page): KV,
  row table, allocator; a kind that writes no KV leaves the pool byte-identical;
- hostile values in the padded tail before staging change nothing, bitwise;
- no history dependence: the same case after the largest batch, another bucket and a poisoned
  run gives the same bits;
- static buffers never move; outputs are fresh memory and keep their values;
- for a probe that lists its key widths (``KeyWidthProbe``): every kind at key lengths either
  side of every width up to the profile's longest context boundary (the gate: 512; the full
  profile: the model's context limit), graph == eager, on the smallest width that holds the
  case (a second engine, with a pool for the longest context).

What the probe reports is bounded (``check_probe_bounds``, ``checked_tolerance``): a max batch
outside 1..the requests the engine was opened for, or a float tolerance that is not finite or
past the cap for the declared precision, fails the checks. A check that would run nothing on the
probe (no raw size runs padded; no key length reaches a width) is not applicable, with why.

One engine per worker for the tier (and one for the widths): a compiled executor compiles each
key once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from conformance.checks.graph import (
    NotApplicable,
    Recorder,
    check_graph_matches_eager,
    check_key_width_boundaries,
    check_no_history_dependence,
    check_padding_policy,
    check_poisoned_padding,
    check_probe_bounds,
    check_state_untouched,
    check_static_buffers_and_fresh_outputs,
)
from conformance.contract import GraphProbe, KeyWidthProbe
from conformance.plan.requests import context_limit
from conformance.run.context import SuiteContext
from conformance.suites.support import page_for
from conformance.suites.support_extras import graph_probe_handle

pytestmark = [pytest.mark.specgate_tier("graph"), pytest.mark.specgate_requires("graph_runner")]

# Up to 10 requests: buckets 1, 2, 4, 8, 10 for a backend that pads like the reference engine,
# so raw sizes 3, 5, 6, 7 and 9 run padded. A small pool keeps the state digests cheap.
GRAPH_LIMITS = {"max_running_requests": 10, "kv_pool_tokens": 1024, "page_size": 4}
# The key widths: up to 4 requests (raw size 3 runs padded, beside 2 short requests), in a
# pool with room for one at the longest context the profile reaches.
WIDTH_RAW = 3
WIDTH_LIMITS = {"max_running_requests": 4, "page_size": 4}
WIDTH_POOL_SPARE = 512  # tokens past the longest context: the short requests, the draft's room


def _open_probe(sg: SuiteContext, **limits: int) -> Iterator[GraphProbe]:
    limits["page_size"] = page_for(sg, limits["page_size"])
    handle = sg.backend.open(sg.open_config(sg.spec.configs[0], **limits))
    try:
        made = graph_probe_handle(handle).graph_probe()
        assert isinstance(made, GraphProbe), f"graph_probe() returned {type(made).__name__}"
        check_probe_bounds(made, limits["max_running_requests"])
        yield made
    finally:
        handle.close()


@pytest.fixture(scope="module")
def probe(sg: SuiteContext) -> Iterator[GraphProbe]:
    yield from _open_probe(sg, **GRAPH_LIMITS)


def widest_context(sg: SuiteContext) -> int:
    """The longest key length the width check reaches: one past the profile's longest
    context boundary (so a width there is crossed), at most the model's context limit."""
    return min(context_limit(sg.model), max(sg.profile.context_boundaries) + 1)


@pytest.fixture(scope="module")
def wide_probe(sg: SuiteContext) -> Iterator[GraphProbe]:
    yield from _open_probe(sg, kv_pool_tokens=widest_context(sg) + WIDTH_POOL_SPARE,
                           **WIDTH_LIMITS)


def every_kind(probe: GraphProbe, check: Callable[[str], object]) -> None:
    """``check`` on every kind; a check that would run nothing (``NotApplicable``) is not
    applicable, with why: the padding is the same for every kind."""
    try:
        for kind in probe.kinds():
            check(kind)
    except NotApplicable as why:
        pytest.skip(f"not applicable: {why}")


def test_padded_rows_follow_the_policy(probe: GraphProbe) -> None:
    """Not applicable when no raw size runs padded."""
    every_kind(probe, lambda kind: check_padding_policy(probe, kind))


def test_graph_matches_eager_at_every_size(sg: SuiteContext, probe: GraphProbe) -> None:
    for kind in probe.kinds():
        check_graph_matches_eager(probe, kind, precision=sg.caps.precision)


def test_poisoned_padding_changes_nothing(probe: GraphProbe) -> None:
    """Not applicable when no raw size runs padded."""
    every_kind(probe, lambda kind: check_poisoned_padding(probe, kind))


def test_no_history_dependence(probe: GraphProbe) -> None:
    for kind in probe.kinds():
        check_no_history_dependence(probe, kind)


def test_static_buffers_stay_put_and_outputs_are_fresh(probe: GraphProbe) -> None:
    check_static_buffers_and_fresh_outputs(probe)


def test_kinds_without_kv_writes_leave_the_pool_untouched(probe: GraphProbe) -> None:
    """A kind that writes no KV (a frozen-KV draft loop): the whole pool but the dummy page
    is byte-identical around every eager and graph run, at every size."""
    readers = [kind for kind in probe.kinds() if not probe.writes_kv(kind)]
    if not readers:
        pytest.skip("not applicable: every kind this backend replays writes KV")
    rec = Recorder(probe)
    for kind in readers:
        for raw in range(1, probe.max_batch() + 1):
            for mode in ("eager", "graph"):
                check_state_untouched(probe, rec.run(kind, raw, mode))


def test_graph_matches_eager_either_side_of_every_key_width(sg: SuiteContext,
                                                           wide_probe: GraphProbe,
                                                           record_property) -> None:
    """Every kind, key lengths ``w - 1``, ``w``, ``w + 1`` for every key width ``w`` up to
    ``widest_context`` (and what the kind can reach): graph == eager, no state changed outside
    the real rows' KV, and the reported width is the smallest that holds the case. Not
    applicable to a probe that lists no key widths, or when no kind's key lengths in reach
    sit by a width; a kind whose do not is listed in the ``kinds_without_width_cases``
    figure."""
    if not isinstance(wide_probe, KeyWidthProbe):
        pytest.skip("not applicable: the graph probe lists no key widths (key_widths and "
                    "max_context, docs/adapter.md), so it takes no context length")
    unreached = []
    for kind in wide_probe.kinds():
        try:
            check_key_width_boundaries(wide_probe, kind, min(WIDTH_RAW, wide_probe.max_batch()),
                                       up_to=widest_context(sg), precision=sg.caps.precision)
        except NotApplicable as why:
            unreached.append(str(why))
    if len(unreached) == len(wide_probe.kinds()):
        pytest.skip(f"not applicable: {'; '.join(unreached)}")
    if unreached:
        record_property("kinds_without_width_cases", unreached)
