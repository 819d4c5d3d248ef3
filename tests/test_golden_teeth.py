"""Lossless draft regressions the golden tier must catch through per-step acceptance, where a
mean-tau tolerance alone lets them through (bug-zoo mutants ``draft_position_shift``,
``tree_wrong_parent``, ``extend_padding_not_restaged``), and drafters that miss part of what
the target saw, which only the chunked and session traces show (``draft_skips_non_final_chunks``,
``session_drops_draft_kv``: the plain trace passes them), a drafter that does not go on from a
re-prefilled context, which only the retraction trace shows
(``draft_after_retract_from_prompt_feature``), and n-gram contexts missing tokens
(``ngram_context_skips_bonus``, ``ngram_context_from_last_chunk``)."""

from __future__ import annotations

from collections import Counter

import pytest

from conformance.backends.mutants import MUTANTS
from conformance.checks import golden
from conformance.checks.golden_scenarios import (
    CHUNKED,
    PLAIN,
    RETRACTED,
    SESSION_TURNS,
    Scenario,
)
from conformance.plan.specs import SPECS
from refengine import EngineConfig, SamplingParams

TOKENS = 64  # the gate profile's golden length of the plain trace (the others run whole)


def golden_problems(mutant_name: str, scenario: Scenario = PLAIN) -> list[str]:
    """The mutant on its spec's first configuration over the scenario's golden trace, run as
    the golden tier runs it (checked to be lossless), compared with the trace."""
    mutant = MUTANTS[mutant_name]
    config = SPECS[mutant.spec].configs[0]
    assert config is not None
    trace = golden.load(config, scenario.trace_name("default"))
    tokens = TOKENS if scenario is PLAIN else trace.sampling.max_new_tokens
    budget = ({} if trace.max_prefill_tokens is None
              else {"max_prefill_tokens": trace.max_prefill_tokens})
    engine = mutant.engine_class(EngineConfig(model="tiny-code", spec=config,
                                              kv_pool_tokens=65536, max_running_requests=64,
                                              cuda_graph=mutant.graphs is not None,
                                              graph_executor=mutant.graphs or "compiled",
                                              retract_every=trace.retract_every or 0,
                                              **budget))
    retracted: Counter[str] = Counter()
    done = golden.run_waves(engine, trace.requests,
                            SamplingParams(max_new_tokens=tokens, temperature=0.0,
                                           ignore_eos=True), retracted)
    outputs = {r.id: list(done[r.id].output_ids) for r in trace.requests}
    assert all(outputs[r.id] == r.output_ids[:tokens] for r in trace.requests), "lossless"
    return golden.compare(trace, outputs, {r.id: list(done[r.id].accept_lens)
                                           for r in trace.requests}, config.num_steps,
                          retracted)


def test_one_position_draft_shift_is_caught_although_mean_tau_is_within_tolerance() -> None:
    problems = golden_problems("draft_position_shift")
    assert any("verify step" in p for p in problems)
    assert not any(p.startswith("mean tau") for p in problems)  # 0.9% off: inside 5%


def test_wrong_parent_tree_is_caught_per_step() -> None:
    problems = golden_problems("tree_wrong_parent")
    assert sum("verify step" in p for p in problems) >= 10


def test_stale_extend_padding_is_lossless_but_caught_per_step() -> None:
    """The graphed draft-extend's padded columns write the head's KV into stale slots: every
    token is still the target's, the acceptance is not."""
    problems = golden_problems("extend_padding_not_restaged")
    assert any("verify step" in p for p in problems)


def test_a_draft_that_skips_middle_chunks_is_caught_by_the_chunked_trace() -> None:
    """The head's KV is written only in prefill steps that complete a prompt: a long prompt's
    middle chunks leave holes the draft attends to."""
    problems = golden_problems("draft_skips_non_final_chunks", CHUNKED)
    assert any("verify step" in p for p in problems), problems


def test_a_session_that_drops_the_draft_kv_is_caught_on_second_turns() -> None:
    """The draft's KV of a session's context is lost between turns: only continuing turns
    (``-t1-``) accept differently."""
    problems = golden_problems("session_drops_draft_kv", SESSION_TURNS)
    assert any("verify step" in p for p in problems), problems
    assert all("-t1-" in p for p in problems if "verify step" in p), problems


def test_an_ngram_context_without_the_bonus_is_caught_per_step() -> None:
    """The n-gram context misses every step's bonus token: lookups end in a hole."""
    problems = golden_problems("ngram_context_skips_bonus")
    assert any("verify step" in p for p in problems), problems


def test_an_ngram_context_from_the_last_chunk_is_caught_by_the_chunked_and_session_traces(
        ) -> None:
    """The n-gram context holds only the prefill that completed the request: a long prompt's
    earlier chunks and, on a session's second turn, the inherited context are missing."""
    chunked = golden_problems("ngram_context_from_last_chunk", CHUNKED)
    assert any("verify step" in p for p in chunked), chunked
    sessions = golden_problems("ngram_context_from_last_chunk", SESSION_TURNS)
    assert any("verify step" in p for p in sessions), sessions
    assert all("-t1-" in p for p in sessions if "verify step" in p), sessions


def test_a_draft_from_the_prompt_feature_after_retraction_is_caught_by_the_retraction_trace(
        ) -> None:
    """After each retraction the head drafts from the prompt's last feature, not the
    re-prefilled context's: only retracted requests (the trace's ``retractions``) accept
    differently, and the hook then retracts others than the trace's."""
    problems = golden_problems("draft_after_retract_from_prompt_feature", RETRACTED)
    retracted = {r.id for r in golden.load(SPECS["eagle"].configs[0],  # type: ignore[arg-type]
                                           RETRACTED.trace_name("default")).requests
                 if r.retractions}
    steps = [p for p in problems if "verify step" in p]
    assert steps, problems
    assert all(p.split(":")[0] in retracted for p in steps), (retracted, problems)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", ["draft_skips_non_final_chunks", "session_drops_draft_kv",
                                    "draft_after_retract_from_prompt_feature"])
def test_the_plain_trace_lets_the_chunk_and_session_drafters_through(mutant: str) -> None:
    """Why the chunked, session and retraction traces exist: the plain trace's prompts never
    leave a prefill step without a completed prompt, open no session and are never
    retracted."""
    assert golden_problems(mutant) == []
