"""The golden traces of a prompt set (``conformance/checks/golden_scenarios.py``): which
requests each holds, the order they run in, and what the committed chunked, session and
retraction traces must contain for the golden tier to check what they are for."""

from __future__ import annotations

import pytest

from conformance.checks import golden
from conformance.checks.golden_scenarios import (
    CHUNK_TOKENS,
    CHUNKED,
    CHUNKED_PROMPTS,
    RETRACT_EVERY,
    RETRACT_PROMPTS,
    RETRACTED,
    SCENARIO_TOKENS,
    SESSION_TURNS,
    SESSIONS,
    TURN_PROMPT_TOKENS,
    Planned,
    sessions_of,
    waves,
)
from conformance.contract import SamplingParams, SpecConfig
from conformance.plan.prompts import load_prompt_set
from conformance.plan.specs import SPECS, config_id

CONFIGS = [c for choice in SPECS.values() for c in choice.configs
           if c is not None and not c.overlap]


def test_waves_put_each_session_turn_after_the_one_before() -> None:
    reqs = [Planned("a", [1]), Planned("s0-0", [2], "s0"), Planned("s1-0", [3], "s1"),
            Planned("s0-1", [4], "s0"), Planned("b", [5]), Planned("s1-1", [6], "s1")]
    assert [[r.id for r in wave] for wave in waves(reqs)] == [
        ["a", "s0-0", "s1-0", "b"], ["s0-1", "s1-1"]]
    assert sessions_of(reqs) == ["s0", "s1"]
    assert [[r.id for r in wave] for wave in waves(reqs[:1])] == [["a"]]


def test_chunked_plan_takes_prompts_of_at_least_three_chunks() -> None:
    planned = CHUNKED.plan(load_prompt_set("default"))
    assert len(planned) == CHUNKED_PROMPTS
    assert all(len(p.prompt_ids) > 2 * CHUNK_TOKENS and p.session_id is None for p in planned)


def test_session_plan_is_two_turns_per_session() -> None:
    planned = SESSION_TURNS.plan(load_prompt_set("default"))
    assert sessions_of(planned) == [f"s{j}" for j in range(SESSIONS)]
    first, second = waves(planned)
    assert [p.session_id for p in first] == [p.session_id for p in second]
    assert all(0 < len(p.prompt_ids) <= TURN_PROMPT_TOKENS for p in second)


def test_retraction_plan_is_the_first_prompts_in_one_batch() -> None:
    cases = load_prompt_set("default")
    planned = RETRACTED.plan(cases)
    assert [p.id for p in planned] == [c.id for c in cases[:RETRACT_PROMPTS]]
    assert waves(planned) == [planned] and RETRACTED.retract_every == RETRACT_EVERY


def bare_trace(requests: list[golden.GoldenRequest], max_prefill_tokens: int | None = None,
               retract_every: int | None = None) -> golden.GoldenTrace:
    """A trace of ``requests`` whose spec, sampling and summary nothing here reads."""
    return golden.GoldenTrace(golden.SCHEMA_VERSION, {}, SpecConfig(), SamplingParams(), "set",
                              requests, golden.summarize([], 3), max_prefill_tokens,
                              retract_every)


def test_a_trace_without_sessions_a_prefill_budget_or_retraction_keeps_its_file_format(
        ) -> None:
    request = golden.GoldenRequest("r", [7, 8], [1, 2], [1], None)
    trace = bare_trace([request])
    assert not any(field in trace.to_json() for field in golden.UNSET_OMITTED)
    turn = golden.GoldenRequest("s0-t1", [9], [1, 2], [1], 0, "s0")
    chunked = bare_trace([turn], max_prefill_tokens=64)
    assert golden.GoldenTrace.from_json(chunked.to_json()) == chunked
    retracted = golden.GoldenRequest("r", [7], [1, 2, 3], [1], None, retractions=0)
    under_hook = bare_trace([retracted], retract_every=2)
    assert '"retractions": 0' in under_hook.to_json()
    assert golden.GoldenTrace.from_json(under_hook.to_json()) == under_hook


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_committed_chunked_trace_chunks_every_prompt(config) -> None:  # type: ignore[no-untyped-def]
    trace = golden.load(config, CHUNKED.trace_name("default"))
    assert trace.max_prefill_tokens == CHUNK_TOKENS
    assert trace.sampling.max_new_tokens == SCENARIO_TOKENS
    assert all(len(r.prompt_ids) > 2 * CHUNK_TOKENS for r in trace.requests)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_committed_session_trace_has_comparable_second_turns(config) -> None:  # type: ignore[no-untyped-def]
    """Most second turns must be compared exactly for some verify steps, or the trace could
    not tell a drafter that lost the session's context."""
    trace = golden.load(config, SESSION_TURNS.trace_name("default"))
    assert trace.max_prefill_tokens is None
    second = waves(trace.requests)[1]
    assert len(second) == SESSIONS
    compared = [r for r in second if golden.comparable_steps(
        r.accept_lens, len(r.output_ids) if r.fragile_from is None else r.fragile_from)]
    assert len(compared) >= SESSIONS - 1, [(r.id, r.fragile_from) for r in second]


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_committed_retraction_trace_compares_retracted_requests(config) -> None:  # type: ignore[no-untyped-def]
    """The hook retracted some requests, and most of their verify steps are compared exactly
    (each retraction takes a token off the end): else the trace could not tell a drafter
    that loses the re-prefilled context."""
    trace = golden.load(config, RETRACTED.trace_name("default"))
    assert trace.retract_every == RETRACT_EVERY and trace.max_prefill_tokens is None
    assert trace.sampling.max_new_tokens == SCENARIO_TOKENS
    retracted = [r for r in trace.requests if r.retractions]
    assert len(retracted) >= 2, [(r.id, r.retractions) for r in trace.requests]
    exact = sum(r.exact_steps(len(r.output_ids)) for r in retracted)
    assert exact >= sum(len(r.accept_lens) for r in retracted) // 2, [
        (r.id, r.fragile_from, r.retractions) for r in retracted]
