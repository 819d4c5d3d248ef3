"""``golden.compare``: outputs and per-step accept lengths exact up to the fragile position,
mean tau within its tolerance, over the tokens a run produced."""

from __future__ import annotations

from conformance.checks import golden
from conformance.contract import SamplingParams, SpecConfig


def trace(accept_lens: list[int], fragile_from: int | None = None) -> golden.GoldenTrace:
    output = list(range(1, 2 + sum(accept_lens)))  # index 0 from prefill, then every step
    request = golden.GoldenRequest("r", [7, 8], output, accept_lens, fragile_from)
    return golden.GoldenTrace(golden.SCHEMA_VERSION, {}, SpecConfig(), SamplingParams(), "set",
                              [request], golden.summarize([], 3))


LENS = [4, 1, 3, 4, 2, 4, 4, 1, 3, 4, 4, 2, 4, 4, 3, 4, 4, 4, 1, 4]


def test_identical_run_has_no_problems() -> None:
    t = trace(LENS)
    assert golden.compare(t, {"r": t.requests[0].output_ids}, {"r": list(LENS)}, 3) == []


def test_one_step_shift_fails_although_mean_tau_is_within_tolerance() -> None:
    t = trace(LENS)
    shifted = [*LENS]
    shifted[1], shifted[2] = 2, 2  # one token moves from step 2 to step 1: same mean tau
    problems = golden.compare(t, {"r": t.requests[0].output_ids}, {"r": shifted}, 3)
    assert problems == ["r: verify step 1 accepted 2 tokens, golden 1 (steps compared "
                        f"exactly: {len(LENS)}, before output index {1 + sum(LENS)})"]


def test_steps_past_the_fragile_position_are_not_compared_exactly() -> None:
    t = trace(LENS, fragile_from=12)  # steps 0..2 end at output index 9 <= 12, step 3 at 13
    assert golden.comparable_steps(LENS, 12) == 3
    changed = [*LENS[:3], 3, 3, *LENS[5:]]  # differs only from step 3 on, same total
    assert golden.compare(t, {"r": t.requests[0].output_ids}, {"r": changed}, 3) == []
    early = [LENS[0] - 1, LENS[1] + 1, *LENS[2:]]
    assert "verify step 0 accepted 3 tokens, golden 4" in golden.compare(
        t, {"r": t.requests[0].output_ids}, {"r": early}, 3)[0]


def test_a_shorter_run_is_compared_over_what_it_produced() -> None:
    t = trace(LENS)
    produced = 1 + sum(LENS[:6])
    assert golden.compare(t, {"r": t.requests[0].output_ids[:produced]},
                          {"r": LENS[:6]}, 3) == []


def test_mean_tau_drop_fails_on_its_own() -> None:
    t = trace(LENS, fragile_from=2)  # nothing exact beyond index 2: only the mean is left
    worse = [1] * sum(LENS)
    problems = golden.compare(t, {"r": t.requests[0].output_ids}, {"r": worse}, 3)
    assert len(problems) == 1 and problems[0].startswith("mean tau 1.0 is outside 5%")


def test_output_mismatch_before_the_fragile_position_is_named() -> None:
    t = trace(LENS)
    wrong = [*t.requests[0].output_ids]
    wrong[5] = 0
    assert golden.compare(t, {"r": wrong}, {"r": list(LENS)}, 3) == [
        f"r: output differs from golden at index 5 (before its first fragile position "
        f"{len(wrong)})"]


def retracted_trace(retractions: int) -> golden.GoldenTrace:
    """``LENS`` with ``retractions`` re-prefills among its steps (a token each)."""
    t = trace(LENS)
    output = list(range(1, 2 + sum(LENS) + retractions))
    t.requests[0] = golden.GoldenRequest("r", [7, 8], output, list(LENS), None,
                                         retractions=retractions)
    t.retract_every = 2
    return t


def test_each_retraction_takes_a_token_off_the_steps_compared_exactly() -> None:
    """A re-prefill's token belongs to no verify step and where it fell is not recorded: the
    steps compared exactly stop as many tokens short (here: before the fragile position)."""
    t = retracted_trace(2)
    req = t.requests[0]
    req.fragile_from = 9  # steps 0..2 end at output index 9 without retractions
    assert golden.comparable_steps(LENS, 9) == 3
    assert req.exact_steps(len(req.output_ids)) == golden.comparable_steps(LENS, 7) == 2
    changed = [*LENS[:2], LENS[2] - 1, LENS[3] + 1, *LENS[4:]]  # from step 2 on
    assert golden.compare(t, {"r": req.output_ids}, {"r": changed}, 3, {"r": 2}) == []
    req.retractions = 0
    assert "verify step 2 accepted 2 tokens, golden 3" in golden.compare(
        t, {"r": req.output_ids}, {"r": changed}, 3, {"r": 0})[0]


def test_a_run_that_retracts_other_requests_than_the_trace_fails() -> None:
    t = retracted_trace(2)
    output = t.requests[0].output_ids
    assert golden.compare(t, {"r": output}, {"r": list(LENS)}, 3, {"r": 2}) == []
    assert golden.compare(t, {"r": output}, {"r": list(LENS)}, 3, {}) == [
        "r: retracted 0 times, golden 2 (retract_every 2)"]
    # a run cut short cannot be held to the trace's retractions
    assert golden.compare(t, {"r": output[:10]}, {"r": LENS[:2]}, 3, {}) == []


def test_expected_acceptance_is_the_steps_compared_exactly() -> None:
    t = trace(LENS, fragile_from=12)
    assert golden.expected_acceptance(t, 64) == {"r": LENS[:3]}
    assert golden.expected_acceptance(t, 6) == {"r": LENS[:2]}  # steps ending by index 6
    assert golden.expected_acceptance(trace(LENS, fragile_from=2), 64) == {}
