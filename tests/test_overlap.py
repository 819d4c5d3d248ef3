"""EAGLE V2 (overlap scheduling): lossless against plain decoding and V1 under retraction and
aborts; the reservation and the pre-claimed root slot; stale results change nothing; the
launch thread and the deterministic mode give the same events."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from engine_helpers import SPEC_GREEDY, SPEC_PROMPTS, has_work, spec_engine

from refengine import Engine, FinishEvent, SamplingParams, TokenEvent
from refengine.memory.view import idle_error
from refengine.speculative.modes import overlap_window

PROMPTS, GREEDY = SPEC_PROMPTS, SPEC_GREEDY
CONFIGS = ["chain-s3-n4", "tree-s3-k4-n8"]


def engine(pair: tuple[Path, Path], config: str | None, overlap: bool = True,
           **kw: object) -> Engine:
    return spec_engine(pair, config, overlap, **kw)


@pytest.fixture(scope="module")
def plain_outputs(spec_pair: tuple[Path, Path]) -> list[list[int]]:
    return [o.output_ids for o in engine(spec_pair, None).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("config", CONFIGS)
def test_v2_equals_plain_and_v1(spec_pair: tuple[Path, Path], plain_outputs: list[list[int]],
                                config: str, page_size: int) -> None:
    """Batch and one at a time: the same tokens as plain decoding, and the same acceptance
    as V1 (overlap changes when results apply, not what is drafted or accepted)."""
    v2 = engine(spec_pair, config, page_size=page_size).generate(PROMPTS, GREEDY)
    v1 = engine(spec_pair, config, overlap=False, page_size=page_size).generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in v2] == plain_outputs
    assert [o.accept_lens for o in v2] == [o.accept_lens for o in v1]
    for o in v2:
        assert 1 + sum(o.accept_lens) == len(o.output_ids), o
    single = engine(spec_pair, config, page_size=page_size)
    assert [single.generate([p], GREEDY)[0].output_ids for p in PROMPTS] == plain_outputs
    assert idle_error(single.memory()) is None


def test_sampled_v2_equals_sampled_v1(spec_pair: tuple[Path, Path]) -> None:
    """Seeded sampling draws each output position from its own generator, so V2 (whose
    request state lags the launched steps) must emit exactly V1's sampled tokens."""
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, top_k=8, seed=s,
                             ignore_eos=True) for s in range(len(PROMPTS))]
    outs = {overlap: [o.output_ids for o in
                      engine(spec_pair, "tree-s3-k4-n8", overlap=overlap).generate(PROMPTS, params)]
            for overlap in (False, True)}
    assert outs[True] == outs[False]


@dataclass
class Run:
    outputs: dict[str, list[int]]   # per request its output, [] if aborted
    trace: list[list[str]]          # every step's events, as text
    retractions: int
    doomed: set[str]                # requests that may be aborted


def run_with_retraction_and_aborts(e: Engine) -> Run:
    """All prompts at once under the engine's forced retraction, with seeded random aborts."""
    rng = random.Random(7)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, GREEDY)
    doomed = {f"r{i}" for i in range(len(PROMPTS)) if rng.random() < 0.4}
    outputs: dict[str, list[int]] = {}
    trace: list[list[str]] = []
    retractions = 0
    while has_work(e):
        for rid in sorted(doomed):
            if rng.random() < 0.15:
                e.abort(rid)
        events = e.step()
        trace.append([repr(ev) for ev in events])
        for ev in events:
            retractions += type(ev).__name__ == "RetractEvent"
            if isinstance(ev, FinishEvent):
                outputs[ev.rid] = list(ev.output_ids) if ev.reason != "abort" else []
    return Run(outputs, trace, retractions, doomed)


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "deterministic"])
@pytest.mark.parametrize("config", CONFIGS)
def test_retraction_and_random_aborts(spec_pair: tuple[Path, Path],
                                      plain_outputs: list[list[int]], config: str,
                                      thread: bool) -> None:
    """Forced retraction every 2nd decode step and random aborts: survivors exact, the strict
    memory check on every step, nothing left when idle."""
    e = engine(spec_pair, config, page_size=4, retract_every=2, overlap_thread=thread)
    run = run_with_retraction_and_aborts(e)
    assert run.retractions > 0, "retract_every=2 retracted nothing"
    for i, want in enumerate(plain_outputs):
        got = run.outputs[f"r{i}"]
        assert (got == [] and f"r{i}" in run.doomed) or got == want, (i, got, want)
    assert idle_error(e.memory()) is None


@pytest.mark.parametrize("config", CONFIGS)
def test_thread_and_deterministic_mode_agree(spec_pair: tuple[Path, Path], config: str) -> None:
    """The launch thread changes when work happens, never what: the same events, step by step,
    under forced retraction and aborts."""
    runs = [run_with_retraction_and_aborts(
        engine(spec_pair, config, page_size=4, retract_every=2, overlap_thread=thread))
        for thread in (True, False)]
    assert runs[0].trace == runs[1].trace
    assert runs[0].outputs == runs[1].outputs


def test_reservation_and_preclaim(spec_pair: tuple[Path, Path]) -> None:
    """While a step is in flight its request has pre-claimed its root (committed equals the
    sequence length, one more than sequentially) and holds a reservation ahead of it; the
    bound 2L + page_size - 1 past committed always holds."""
    e = engine(spec_pair, "chain-s3-n4", page_size=4)
    spec = e.config.spec
    assert spec is not None
    two_l = overlap_window(spec)
    e.add_request("a", PROMPTS[0], GREEDY)
    streamed: list[int] = []
    seen_in_flight = False
    while has_work(e):
        events = e.step()
        streamed += [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]
        view = e.memory()
        r = view.requests.get("a")
        if r is None:
            continue
        seq_len = len(e.tokenize(PROMPTS[0])) + len(streamed)
        assert r.allocated - r.committed <= e.reserve_bound == two_l + 3, (r, e.reserve_bound)
        assert r.committed in (seq_len - 1, seq_len), (r, seq_len)
        if r.committed == seq_len:  # in flight: root pre-claimed, reservation topped up
            # Reserved at schedule time to committed + 1 + 2L; the previous step resolved
            # since, committing at most N - 1 <= L - 1 more: at least L + 1 remain, what the
            # in-flight step and the next one's root need.
            seen_in_flight = True
            assert r.allocated >= r.committed + two_l // 2 + 1, (r, two_l)
    assert seen_in_flight
    assert idle_error(e.memory()) is None


def test_results_of_finished_and_aborted_requests_are_stale(spec_pair: tuple[Path, Path],
                                                            plain_outputs: list[list[int]]
                                                            ) -> None:
    """A request that finishes while its next step is in flight gets nothing more; one aborted
    in flight gets nothing at all after the abort; the others run on exactly."""
    e = engine(spec_pair, "chain-s3-n4")
    short = replace(GREEDY, max_new_tokens=2)  # finishes at its first verify's resolution
    e.add_request("short", PROMPTS[0], short)
    e.add_request("victim", PROMPTS[1], GREEDY)
    e.add_request("keeper", PROMPTS[2], GREEDY)
    tokens: dict[str, list[int]] = {"short": [], "victim": [], "keeper": []}
    finished: dict[str, str] = {}
    aborted_at = None
    while has_work(e):
        events = e.step()
        for ev in events:
            if isinstance(ev, TokenEvent):
                assert ev.rid not in finished, f"token for {ev.rid} after it finished: {ev}"
                tokens[ev.rid] += list(ev.token_ids)
            elif isinstance(ev, FinishEvent):
                finished[ev.rid] = ev.reason
        if aborted_at is None and len(tokens["victim"]) > 1:
            e.abort("victim")  # its launched step is in flight right now
            aborted_at = len(tokens["victim"])
    assert tokens["short"] == plain_outputs[0][:2] and finished["short"] == "length"
    assert finished["victim"] == "abort" and len(tokens["victim"]) == aborted_at
    assert tokens["victim"] == plain_outputs[1][:aborted_at]
    assert tokens["keeper"] == plain_outputs[2]
    assert idle_error(e.memory()) is None
