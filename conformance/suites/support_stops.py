"""Stops placed on the reference's output (the lifecycle tier): which requests' stops can be
compared when a backend leaves the reference's output at a near-tie, the output offsets where
a stop string can complete, and the run that checks stop strings end a request where they
complete, with the reference's finish text."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from conformance.repro.driver import Outcome
from conformance.run.context import SuiteContext
from conformance.suites.support import greedy, near_tied, open_driver, run_all


def stops_to_compare(sg: SuiteContext, prompt: list[int], outcomes: Mapping[str, Outcome],
                     ends: Mapping[str, int]) -> list[str]:
    """Of the requests (rid -> the tokens the reference emits up to its placed stop), those
    whose stop can be compared: not those whose output first differs from the reference's at
    a near-tie before that end (``near_tied``, listed): they continue another prefix. Not
    applicable (skipped, saying why) when that leaves none."""
    tied = near_tied(sg, {rid: outcomes[rid].output_ids for rid in ends},
                     {rid: (prompt, greedy(n)) for rid, n in ends.items()})
    if len(tied) == len(ends):
        pytest.skip(f"not applicable: each of the {len(ends)} request(s) left the reference's "
                    f"output at a near-tie before its stop (listed in near_ties)")
    return [rid for rid in ends if rid not in tied]


def string_offsets(sg: SuiteContext, want: list[int]) -> Iterator[tuple[int, str, str]]:
    """``(i, before, text)`` for the first output indices i whose token adds whole characters
    of its own after a non-empty text: ``before`` decodes ``want[:i]``, ``text``
    ``want[:i + 1]``. A stop string ending in token i's characters completes at i."""
    for i in range(1, 17):
        before, text = sg.oracle.decode(want[:i]), sg.oracle.decode(want[:i + 1])
        if before and text.startswith(before) and len(text) > len(before):
            yield i, before, text


def assert_stop_strings(sg: SuiteContext, prompt: list[int], want: list[int],
                        stops: dict[str, tuple[int, tuple[str, ...]]]) -> None:
    """Run each request (its rid -> the output index its stop strings complete at, the
    strings): each ends at that index's token, reason ``stop``, with the reference's finish
    text (cut before the earliest stop string in it); nothing after it is emitted."""
    requests = {rid: (prompt, greedy(24, stop=strings)) for rid, (_, strings) in stops.items()}
    with open_driver(sg) as driver:
        outcomes = run_all(driver, requests)
    for rid in stops_to_compare(sg, prompt, outcomes,
                                {rid: i + 1 for rid, (i, _) in stops.items()}):
        i, strings = stops[rid]
        ids, text = want[:i + 1], sg.oracle.finish_text(want[:i + 1], strings)
        o = outcomes[rid]
        assert (o.output_ids, o.reason, o.text) == (ids, "stop", text), (
            f"{rid} (stop strings {strings!r}): got {len(o.output_ids)} tokens ({o.reason}) and "
            f"text ending {o.text[-12:]!r}; expected {len(ids)} tokens (stop) and text ending "
            f"{text[-12:]!r}")
