"""Acceptance A3: under KV pressure (retraction) and random aborts, surviving requests produce
exactly the unconstrained outputs, and the memory invariants M1-M3 hold after every step."""

from __future__ import annotations

import gc
import random
import weakref
from pathlib import Path

import pytest
from engine_helpers import Run, drive, has_work
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refengine import Engine, EngineConfig, RetractEvent, SamplingParams
from refengine.memory.view import bounds_error, ceil_page, conservation_error, idle_error

MAX_NEW = 32
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
_rng = random.Random(2024)
PROMPTS: dict[str, list[int]] = {
    f"q{i:02d}": [_rng.randrange(1, 2048) for _ in range(_rng.randint(10, 40))]
    for i in range(16)
}
LARGEST = max(len(p) for p in PROMPTS.values()) + MAX_NEW


def run_engine(model_dir: Path, kv_pool_tokens: int, page_size: int, max_prefill_tokens: int,
               aborts: dict[str, int], rids: list[str] | None = None
               ) -> tuple[Run, Engine, list[weakref.ref[object]]]:
    """Run the prompts (``rids``, default all) to completion, aborting ``rid`` just before step
    ``aborts[rid]``; check M1, M2 and M3 after every step."""
    engine = Engine(EngineConfig(model=str(model_dir), kv_pool_tokens=kv_pool_tokens,
                                 page_size=page_size, max_prefill_tokens=max_prefill_tokens,
                                 strict_mem_check=True))
    rids = rids if rids is not None else sorted(PROMPTS)
    for rid in rids:
        engine.add_request(rid, PROMPTS[rid], PARAMS)
    refs = [weakref.ref(engine._live[rid]) for rid in rids]
    run = Run()

    def before(step: int) -> None:
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)

    def check(step: int, events: list[object]) -> None:
        view = engine.memory()
        assert conservation_error(view) is None, (step, conservation_error(view))
        assert bounds_error(view) is None, (step, bounds_error(view))
        assert view.reserve_bound == 0
        for rid, req in view.requests.items():
            if req.phase == "decode":  # M3: the newest token gets its KV in the next forward
                expected = len(PROMPTS[rid]) + len(run.tokens[rid]) - 1
                assert req.committed == expected, (step, rid, req)
            assert ceil_page(req.allocated, page_size) <= view.capacity - view.free

    drive(engine, before_step=before, after_step=check, run=run)
    return run, engine, refs


@pytest.fixture(scope="module")
def unconstrained(random_model_dir: Path) -> dict[str, list[int]]:
    """Outputs with a pool big enough for everything at once and no aborts."""
    run, _, _ = run_engine(random_model_dir, 4096, 1, 2048, {})
    assert run.retractions == 0
    assert all(len(t) == MAX_NEW for t in run.tokens.values())
    return run.tokens


def check_outcome(run: Run, engine: Engine, refs: list[weakref.ref[object]],
                  unconstrained: dict[str, list[int]], aborts: dict[str, int]) -> int:
    """Survivors match the unconstrained run; aborted requests stopped on a prefix of it.
    Returns how many requests were actually aborted."""
    aborted = 0
    for rid, fin in run.finishes.items():
        tokens = run.tokens.get(rid, [])
        if fin.reason == "abort":
            assert rid in aborts, f"{rid} aborted without being asked to"
            assert tokens == unconstrained[rid][:len(tokens)]
            assert len(tokens) < MAX_NEW
            aborted += 1
        else:
            assert fin.reason == "length"
            assert tokens == unconstrained[rid], f"{rid} differs from the unconstrained run"
    assert idle_error(engine.memory()) is None
    gc.collect()
    assert all(r() is None for r in refs), "a finished request is kept alive"
    return aborted


@pytest.mark.parametrize("max_prefill_tokens", [2048, 24])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("abort_seed", [0, 1])
def test_retraction_with_random_aborts(random_model_dir: Path,
                                       unconstrained: dict[str, list[int]], page_size: int,
                                       max_prefill_tokens: int, abort_seed: int) -> None:
    rng = random.Random(abort_seed)
    victims = rng.sample(sorted(PROMPTS), k=len(PROMPTS) // 4)
    aborts = {rid: rng.randrange(0, 60) for rid in victims}  # runs take ~65-95 steps
    run, engine, refs = run_engine(random_model_dir, 400, page_size, max_prefill_tokens, aborts)
    assert set(run.finishes) == set(PROMPTS)
    assert run.retractions > 0, "the pool was not small enough to force a retraction"
    aborted = check_outcome(run, engine, refs, unconstrained, aborts)
    assert aborted > 0, "no abort hit a live request"
    # Retracted requests resumed and still matched (checked above); some of them survived.
    retracted = {e.rid for step in run.events for e in step if isinstance(e, RetractEvent)}
    assert any(run.finishes[rid].reason == "length" for rid in retracted)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_without_aborts(random_model_dir: Path, unconstrained: dict[str, list[int]],
                                   page_size: int) -> None:
    run, engine, refs = run_engine(random_model_dir, 300, page_size, 2048, {})
    assert run.retractions > 0
    assert check_outcome(run, engine, refs, unconstrained, {}) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_a_retracted_request(random_model_dir: Path, unconstrained: dict[str, list[int]],
                                   page_size: int) -> None:
    """A request aborted while it waits to re-prefill after a retraction frees nothing twice
    and reports the output it had; the others are unaffected."""
    engine = Engine(EngineConfig(model=str(random_model_dir), kv_pool_tokens=300,
                                 page_size=page_size))
    for rid in sorted(PROMPTS):
        engine.add_request(rid, PROMPTS[rid], PARAMS)
    run = Run()
    victim = None
    while victim is None:
        assert has_work(engine), "no retraction happened"
        events = run.step(engine)
        victim = next((e.rid for e in events if isinstance(e, RetractEvent)), None)
    assert victim not in engine.memory().requests  # KV and row already freed
    had = list(run.tokens[victim])
    assert had, "a retracted request has output (it was decoding)"
    engine.abort(victim)
    assert idle_error(engine.memory()) is not None  # others still run
    drive(engine, run=run)
    assert run.finishes[victim].reason == "abort"
    assert run.tokens[victim] == had == unconstrained[victim][:len(had)]
    for rid in PROMPTS:
        if rid != victim:
            assert run.tokens[rid] == unconstrained[rid], rid
    assert idle_error(engine.memory()) is None


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pool=st.integers(LARGEST, 640), page_size=st.sampled_from([1, 2, 4, 8]),
       max_prefill_tokens=st.sampled_from([8, 32, 2048]),
       count=st.integers(4, 16),
       aborts=st.dictionaries(st.sampled_from(sorted(PROMPTS)), st.integers(0, 60),
                              max_size=5))
def test_retraction_property(random_model_dir: Path, unconstrained: dict[str, list[int]],
                             pool: int, page_size: int, max_prefill_tokens: int, count: int,
                             aborts: dict[str, int]) -> None:
    pool = max(pool, ceil_page(LARGEST, page_size))
    rids = sorted(PROMPTS)[:count]
    aborts = {rid: at for rid, at in aborts.items() if rid in rids}
    run, engine, refs = run_engine(random_model_dir, pool, page_size, max_prefill_tokens,
                                   aborts, rids)
    assert set(run.finishes) == set(rids)
    check_outcome(run, engine, refs, unconstrained, aborts)
