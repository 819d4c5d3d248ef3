"""Streaming sessions: a turn reuses its session's KV (cached prefix = the context minus its
final token, the same under plain, V1 and V2), greedy output equals a fresh request over the
whole context, abort and retraction roll back to the previous turn, close frees everything,
and bad use is one clear ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import drive, spec_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine import Engine, FinishEvent, RetractEvent, SamplingParams
from refengine.memory.view import ceil_page

ENGINES = [(None, False), ("chain-s3-n4", False), ("tree-s3-k4-n8", False),
           ("chain-s3-n4", True)]
ENGINE_IDS = ["plain", "v1-chain", "v1-tree", "v2-chain"]
TURNS = ["def fib(n):", "\n# and now\n", "class Foo:", "x"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def turn(engine: Engine, session: str, rid: str, prompt: str, n: int) -> FinishEvent:
    engine.add_request(rid, engine.tokenize(prompt), greedy(n), session_id=session)
    return drive(engine).finishes[rid]


def assert_all_free(engine: Engine) -> None:
    view = engine.memory()
    assert (view.free, view.rows_free, view.held, view.rows_held) == (
        view.capacity, view.rows_capacity, 0, 0), view


@pytest.fixture(scope="module")
def fresh(spec_pair: tuple[Path, Path]) -> Engine:
    return spec_engine(spec_pair, None)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("config", "overlap"), ENGINES, ids=ENGINE_IDS)
def test_turns_reuse_the_session_kv(spec_pair: tuple[Path, Path], fresh: Engine,
                                    config: str | None, overlap: bool, page_size: int) -> None:
    engine = spec_engine(spec_pair, config, overlap, page_size=page_size,
                         strict_mem_check=True)
    engine.open_session("s")
    context: list[int] = []
    for t, text in enumerate(TURNS):
        new = engine.tokenize(text)
        fin = turn(engine, "s", f"t{t}", text, 5 + 3 * t)
        assert fin.cached_tokens == max(len(context) - 1, 0), (t, fin.cached_tokens)
        want = fresh.generate([context + new], greedy(5 + 3 * t))[0].output_ids
        assert list(fin.output_ids) == want, f"turn {t} differs from a fresh request"
        context += new + list(fin.output_ids)
        view = engine.memory()
        assert view.rows_held == 1 and view.held == ceil_page(len(context) - 1, page_size)
        assert view.free + view.held == view.capacity
    engine.close_session("s")
    assert_all_free(engine)


@pytest.mark.parametrize(("config", "overlap"), ENGINES, ids=ENGINE_IDS)
def test_abort_rolls_the_session_back(spec_pair: tuple[Path, Path], config: str | None,
                                      overlap: bool) -> None:
    engine = spec_engine(spec_pair, config, overlap, page_size=4, strict_mem_check=True)
    engine.open_session("s")
    first = turn(engine, "s", "t0", TURNS[0], 6)
    held_before = engine.memory().held
    engine.add_request("t1", engine.tokenize(TURNS[1]), greedy(30), session_id="s")
    run = drive(engine, after_step=lambda i, _: engine.abort("t1") if i == 3 else None)
    assert run.finishes["t1"].reason == "abort"
    assert run.tokens["t1"], "the aborted turn never decoded: the rollback went unchecked"
    assert engine.memory().held == held_before
    again = turn(engine, "s", "t2", TURNS[2], 4)
    context = len(engine.tokenize(TURNS[0])) + len(first.output_ids)
    assert again.cached_tokens == context - 1, "the aborted turn was not rolled back"
    engine.close_session("s")
    assert_all_free(engine)


@pytest.mark.parametrize(("config", "overlap"), ENGINES, ids=ENGINE_IDS)
def test_retracted_turn_keeps_its_prefix(spec_pair: tuple[Path, Path], fresh: Engine,
                                         config: str | None, overlap: bool) -> None:
    engine = spec_engine(spec_pair, config, overlap, retract_every=2, strict_mem_check=True)
    engine.open_session("s")
    first = turn(engine, "s", "t0", TURNS[0], 6)
    context = engine.tokenize(TURNS[0]) + list(first.output_ids)
    engine.add_request("t1", engine.tokenize(TURNS[1]), greedy(16), session_id="s")
    prefixes: list[int] = []
    run = drive(engine, after_step=lambda i, events: prefixes.extend(
        engine.memory().requests["t1"].committed for e in events
        if isinstance(e, RetractEvent)))
    assert prefixes and set(prefixes) == {len(context) - 1}, prefixes
    want = fresh.generate([context + engine.tokenize(TURNS[1])], greedy(16))[0].output_ids
    assert list(run.finishes["t1"].output_ids) == want
    assert run.finishes["t1"].cached_tokens == len(context) - 1
    engine.close_session("s")
    assert_all_free(engine)


def test_bad_session_use_is_one_clear_error(spec_pair: tuple[Path, Path]) -> None:
    engine = spec_engine(spec_pair, None)
    with pytest.raises(ValueError, match="no open session 'nope'"):
        engine.add_request("r", [1, 2], greedy(2), session_id="nope")
    with pytest.raises(ValueError, match="no open session 'nope'"):
        engine.close_session("nope")
    engine.open_session("s")
    with pytest.raises(ValueError, match="already open"):
        engine.open_session("s")
    with pytest.raises(ValueError, match="non-empty string"):
        engine.open_session("")
    engine.add_request("a", [1, 2], greedy(4), session_id="s")
    with pytest.raises(ValueError, match="already has a live turn 'a'"):
        engine.add_request("b", [3], greedy(4), session_id="s")
    with pytest.raises(ValueError, match="still has a live turn 'a'"):
        engine.close_session("s")
    drive(engine)
    engine.close_session("s")
    assert_all_free(engine)


@settings(max_examples=12, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["turn", "abort", "close"]),
                              st.integers(0, 2), st.integers(1, 8)), min_size=1, max_size=10),
       page_size=st.sampled_from([1, 4]))
def test_session_ops_keep_accounting(spec_pair: tuple[Path, Path], ops: list[tuple[str, int, int]],
                                     page_size: int) -> None:
    """Random turns, aborts and closes over three sessions: the engine's strict check holds at
    every step, each turn's cached prefix is its session's context minus one, and once every
    session is closed the pool is whole."""
    engine = spec_engine(spec_pair, "chain-s3-n4", True, page_size=page_size,
                         kv_pool_tokens=1024, strict_mem_check=True)
    contexts: dict[str, list[int]] = {}
    for i, (op, which, n) in enumerate(ops):
        sid = f"s{which}"
        if op == "close" and sid in contexts:
            engine.close_session(sid)
            del contexts[sid]
            continue
        if sid not in contexts:
            engine.open_session(sid)
            contexts[sid] = []
        prompt = [(7 * i + j) % 200 + 3 for j in range(n)]
        rid = f"r{i}"
        engine.add_request(rid, prompt, greedy(n + 2), session_id=sid)
        run = drive(engine, after_step=(lambda step, _, rid=rid: engine.abort(rid)
                                        if step == 1 else None) if op == "abort" else None)
        fin = run.finishes[rid]
        assert fin.cached_tokens == max(len(contexts[sid]) - 1, 0)
        if fin.reason != "abort":
            contexts[sid] += prompt + list(fin.output_ids)
    for sid in contexts:
        engine.close_session(sid)
    assert_all_free(engine)
