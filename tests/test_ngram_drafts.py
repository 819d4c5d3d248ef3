"""The n-gram drafting rule (``conformance/checks/ngram_drafts.py``): the drafts it says every
correct prompt-lookup drafter proposes are refengine's lookup's first tokens, and a model of
vLLM's; a simulated correct engine (greedy verify of either drafter's chain) never breaks the
rule; a drafter that copies from one position late does (Hypothesis, random contexts and
targets). vLLM's own lookup is held to it in tests/test_vllm_planted.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.ngram_drafts import common_proposal, determined_steps, violations
from refengine.config import NGRAM_MAX, NGRAM_MIN
from refengine.speculative.ngram_lookup import propose

Drafter = Callable[[list[int], int], list[int]]
Target = Callable[[list[int]], int]

contexts = st.lists(st.integers(0, 3), min_size=1, max_size=40)
step_counts = st.integers(1, 6)


def refengine_drafts(context: list[int], steps: int) -> list[int]:
    """refengine's lookup: the latest occurrence, copied on with the match's period."""
    return propose(torch.tensor([context]), torch.tensor([len(context)]), steps, NGRAM_MIN,
                   NGRAM_MAX)[0].tolist()


def earliest_drafts(context: list[int], steps: int, late: int = 0) -> list[int]:
    """The lookup as vLLM 0.32 specifies it: the earliest occurrence of the longest suffix
    with one, copied up to the context's end; nothing without a match. ``late``: the copy
    starts that many positions past the match's end (1: the planted bug)."""
    end = len(context)
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        found = [s for s in range(end - n) if context[s:s + n] == context[end - n:]]
        if found:
            return context[found[0] + n + late:][:steps]
    return []


def table_target(table: Sequence[int]) -> Target:
    """A greedy 'model': the next token is a fixed function of the last two."""
    return lambda ctx: table[4 * ctx[-2] + ctx[-1]] if len(ctx) > 1 else table[ctx[-1]]


def simulate(prompt: list[int], target: Target, drafter: Drafter, steps: int, tokens: int
             ) -> tuple[list[int], list[int]]:
    """A correct greedy speculative engine: -> (output, accept_lens)."""
    output = [target(prompt)]
    lens = []
    while len(output) < tokens:
        context = prompt + output
        emitted: list[int] = []
        for draft in drafter(context, steps):
            emitted.append(target(context + emitted))
            if emitted[-1] != draft:
                break
        else:
            emitted.append(target(context + emitted))  # every draft accepted: the bonus
        emitted = emitted[:tokens - len(output)]
        output += emitted
        lens.append(len(emitted))
    return output, lens


@settings(max_examples=300, deadline=None)
@given(contexts, step_counts)
def test_both_lookups_start_with_the_common_proposal(context: list[int], steps: int) -> None:
    proposal = common_proposal(context, steps)
    if proposal is not None:
        assert refengine_drafts(context, steps)[:len(proposal)] == list(proposal)
        assert earliest_drafts(context, steps)[:len(proposal)] == list(proposal)


@settings(max_examples=200, deadline=None)
@given(contexts, st.lists(st.integers(0, 3), min_size=16, max_size=16), step_counts,
       st.integers(1, 24), st.sampled_from(["refengine", "earliest"]))
def test_a_correct_engine_never_breaks_the_rule(prompt: list[int], table: list[int], steps: int,
                                                tokens: int, lookup: str) -> None:
    drafter = refengine_drafts if lookup == "refengine" else earliest_drafts
    output, lens = simulate(prompt, table_target(table), drafter, steps, tokens)
    assert violations(determined_steps(prompt, output, lens, steps), lens) == []


@settings(max_examples=200, deadline=None)
@given(contexts, st.lists(st.integers(0, 3), min_size=16, max_size=16), step_counts,
       st.integers(1, 24))
def test_a_one_late_drafter_is_flagged_where_it_loses_the_agreed_draft(
        prompt: list[int], table: list[int], steps: int, tokens: int) -> None:
    """Wherever the agreed first draft is the target's token and the late chain does not start
    with it, the late engine emits one token where a correct one emits two or more."""
    output, lens = simulate(prompt, table_target(table),
                            lambda c, s: earliest_drafts(c, s, late=1), steps, tokens)
    rules = determined_steps(prompt, output, lens, steps)
    flagged = {v.rule.step for v in violations(rules, lens)}
    for r in rules:
        late = earliest_drafts(prompt + output[:r.start], steps, late=1)
        if output[r.start] == r.proposal[0] and late[:1] != [r.proposal[0]] and r.emits > 1:
            assert r.step in flagged


def test_a_periodic_text_catches_the_one_late_copy() -> None:
    cycle: Target = lambda ctx: (ctx[-1] + 1) % 7  # noqa: E731
    prompt = [0, 1, 2, 3, 4, 5, 6, 0, 1]
    output, lens = simulate(prompt, cycle, earliest_drafts, 3, 12)
    assert lens == [4, 4, 3]    # every draft accepted (the last step cut by the length)
    assert violations(determined_steps(prompt, output, lens, 3), lens) == []
    late_output, late = simulate(prompt, cycle, lambda c, s: earliest_drafts(c, s, late=1), 3,
                                 12)
    assert late_output == output and late[0] == 1
    found = violations(determined_steps(prompt, late_output, late, 3), late)
    assert found[0].describe() == ("verify step 0 (output index 1) emitted 1 tokens, expected "
                                   "at least 4: every prompt-lookup drafter proposes [3, 4, 5]")


@pytest.mark.parametrize(("context", "steps", "proposal"), [
    ([5, 6, 7, 5, 6], 5, (7, 5, 6)),        # refengine 7 5 6 7 5, vLLM 7 5 6
    ([1, 2, 9, 1, 2, 8, 1, 2], 3, None),    # refengine 8 1 2, vLLM 9 1 2: nothing agreed
    ([1, 2, 9, 1, 2, 9, 7, 1, 2], 3, (9,)),  # after 1 2: 9 1 2 9 7 .. and 9 7 ..: agree on 9
    ([3, 3, 3, 3], 2, None),                # every occurrence overlaps the suffix
    ([4, 1, 2, 3], 3, None),                # no earlier occurrence of any suffix
])
def test_hand_made_contexts(context: list[int], steps: int,
                            proposal: tuple[int, ...] | None) -> None:
    assert common_proposal(context, steps) == proposal


def test_exact_where_a_known_draft_was_rejected() -> None:
    # root 2 at output index 0; context 0 1 2 9 0 1 2: P = 9 0 1; output goes 9 5 ...
    prompt, output = [0, 1, 2, 9, 0, 1], [2, 9, 5, 7]
    rules = determined_steps(prompt, output, [2, 1], 3)
    assert [(r.step, r.proposal, r.emits, r.exact) for r in rules] == [(0, (9, 0, 1), 2, True)]
    assert violations(rules, [2, 1]) == []
    over = determined_steps(prompt, output, [3], 3)     # one draft more than the verify allows
    assert [(v.rule.step, v.got) for v in violations(over, [3])] == [(0, 3)]


def test_accept_lens_must_account_for_the_output() -> None:
    with pytest.raises(ValueError, match="do not account for 4 output tokens"):
        determined_steps([1, 2], [3, 4, 5, 6], [1, 1], 3)
