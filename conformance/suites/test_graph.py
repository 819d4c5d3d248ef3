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
- static buffers never move; outputs are fresh memory and keep their values.

One engine per worker for the tier: a compiled executor compiles each key once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conformance.checks.graph import (
    Recorder,
    check_graph_matches_eager,
    check_no_history_dependence,
    check_padding_policy,
    check_poisoned_padding,
    check_state_untouched,
    check_static_buffers_and_fresh_outputs,
)
from conformance.contract import GraphProbe
from conformance.run.plugin import SuiteContext

pytestmark = [pytest.mark.specgate_tier("graph"), pytest.mark.specgate_requires("graph_runner")]

# Up to 10 requests: buckets 1, 2, 4, 8, 10 for a backend that pads like the reference engine,
# so raw sizes 3, 5, 6, 7 and 9 run padded. A small pool keeps the state digests cheap.
GRAPH_LIMITS = {"max_running_requests": 10, "kv_pool_tokens": 1024, "page_size": 4}


@pytest.fixture(scope="module")
def probe(sg: SuiteContext) -> Iterator[GraphProbe]:
    handle = sg.backend.open(sg.open_config(sg.spec.configs[0], **GRAPH_LIMITS))
    try:
        made = handle.graph_probe()  # type: ignore[attr-defined]
        assert isinstance(made, GraphProbe), f"graph_probe() returned {type(made).__name__}"
        yield made
    finally:
        handle.close()


def test_padded_rows_follow_the_policy(probe: GraphProbe) -> None:
    kinds, buckets = probe.kinds(), probe.buckets()
    assert kinds, "the probe replays no kind"
    assert list(buckets) == sorted(set(buckets)) and buckets[0] >= 1, buckets
    assert probe.max_batch() <= buckets[-1], (probe.max_batch(), buckets)
    for kind in kinds:
        check_padding_policy(probe, kind)


def test_graph_matches_eager_at_every_size(probe: GraphProbe) -> None:
    for kind in probe.kinds():
        check_graph_matches_eager(probe, kind)


def test_poisoned_padding_changes_nothing(probe: GraphProbe) -> None:
    for kind in probe.kinds():
        check_poisoned_padding(probe, kind)


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
        pytest.skip("every kind this backend replays writes KV")
    rec = Recorder(probe)
    for kind in readers:
        for raw in range(1, probe.max_batch() + 1):
            for mode in ("eager", "graph"):
                check_state_untouched(probe, rec.run(kind, raw, mode))
