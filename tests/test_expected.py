"""Committed expected outputs: the recorded file matches the fixture, requests are answered from
it by the adapter contract's stop and length rules, the oracle uses it before the engine, and
recording refuses to write what transformers contradicts."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks import expected as exp
from conformance.checks import expected_record as rec
from conformance.checks.oracle import NEAR_TIE_EPSILON, ReferenceOracle
from conformance.plan.profiles import PROFILES
from conformance.plan.prompts import load_prompt_set
from refengine import SamplingParams

MODEL = "tiny-code"


@cache
def committed() -> exp.ExpectedOutputs:
    found = exp.load_expected(MODEL)
    assert found is not None, f"no committed outputs for {MODEL} (or its files changed)"
    return found


def greedy(n: int, **kw: object) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_committed_file_is_current_and_round_trips() -> None:
    """Recorded from today's fixture files (else the oracle silently runs the engine), and
    what the record command writes reads back unchanged."""
    found = committed()
    assert found.fixture_digest == exp.fixture_digest(MODEL)
    assert exp.expected_path(MODEL).read_text() == found.to_json()
    assert exp.ExpectedOutputs.from_json(found.to_json()) == found


def test_every_prompt_the_tiers_use_is_recorded_long_enough() -> None:
    wanted = rec.covered_prompts(MODEL)
    for profile in PROFILES.values():
        assert {exp.prompt_key(c.ids) for c in load_prompt_set(profile.prompt_set)} <= set(wanted)
    for key, (prompt, length) in wanted.items():
        cont = committed().continuations[key]
        room = min(length, committed().context_limit - len(prompt))
        assert cont.prompt_len == len(prompt) and len(cont.tokens) == room, key
        assert len(cont.runner_up) == len(cont.margins) == room, key


def test_not_covered() -> None:
    prompt = load_prompt_set("small")[0].ids
    found = committed()
    assert found.greedy(prompt, greedy(exp.PROMPT_SET_TOKENS + 1)) is None   # past the record
    assert found.greedy(prompt, greedy(4, stop=("x",))) is None              # stop strings
    assert found.greedy(prompt, SamplingParams(max_new_tokens=4, temperature=1.0)) is None
    assert found.greedy((*prompt, 7), greedy(4)) is None                      # not recorded


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, exp.PROMPT_SET_TOKENS), stop_at=st.integers(0, 80),
       ignore_eos=st.booleans())
def test_stop_and_length_rules(n: int, stop_at: int, ignore_eos: bool) -> None:
    """A prefix of the continuation: cut by max_new_tokens, after the first stop token (kept),
    after EOS unless ignore_eos."""
    prompt = load_prompt_set("small")[1].ids
    tokens = list(committed().lookup(prompt).tokens)
    stop = tokens[stop_at % len(tokens)]
    got = committed().greedy(prompt, greedy(n, stop_token_ids=(stop,), ignore_eos=ignore_eos))
    eos = committed().eos_token_id
    ends = [i for i, t in enumerate(tokens) if t == stop or (t == eos and not ignore_eos)]
    assert got == tokens[:min(n, ends[0] + 1)]


def test_context_limit_ends_by_length() -> None:
    """The long context at the limit was recorded up to it: any longer request is covered
    and ends there."""
    found = committed()
    at_limit = [(k, c) for k, c in found.continuations.items()
                if c.prompt_len + len(c.tokens) == found.context_limit]
    assert at_limit, "no recorded prompt reaches the context limit"
    key, cont = at_limit[0]
    prompt = next(p for k, (p, _) in rec.covered_prompts(MODEL).items() if k == key)
    assert found.greedy(prompt, greedy(500)) == list(cont.tokens)


def test_oracle_answers_covered_requests_without_the_engine() -> None:
    oracle = ReferenceOracle(MODEL)
    prompt = load_prompt_set("small")[2].ids
    want = oracle.greedy(prompt, greedy(32))
    stop = oracle.greedy(prompt, greedy(24, stop_token_ids=(want[5],)))
    assert want == list(committed().lookup(prompt).tokens[:32]) and stop[-1] == want[5]
    assert oracle.fallbacks == 0 and "engine" not in vars(oracle)
    # a confident flip to the recorded runner-up is judged from the committed margins alone
    cont = committed().lookup(prompt)
    at = max(range(32), key=lambda i: cont.margins[i])
    found = oracle.divergence(prompt, greedy(32), [*want[:at], cont.runner_up[at]],
                              NEAR_TIE_EPSILON["float32"])
    assert found is not None and not found.near_tie and found.gap == cont.margins[at]
    assert "engine" not in vars(oracle)


def test_oracle_runs_the_engine_for_what_is_not_covered() -> None:
    prompt = tuple(range(5, 25))
    oracle = ReferenceOracle(MODEL)
    live = ReferenceOracle(MODEL, expected=None)
    assert oracle.greedy(prompt, greedy(6)) == live.greedy(prompt, greedy(6))
    assert oracle.fallbacks == live.fallbacks == 1


def test_committed_outputs_equal_the_engines() -> None:
    """The engine of this checkout still decodes what was recorded (one short prompt; the
    suite's own tiers compare every other)."""
    prompt = load_prompt_set("small")[3].ids
    assert ReferenceOracle(MODEL, expected=None).greedy(prompt, greedy(12)) == \
        ReferenceOracle(MODEL).greedy(prompt, greedy(12))


def test_recording_refuses_what_transformers_contradicts() -> None:
    """HF's argmax differing from the reference by more than the float32 epsilon refuses the
    record; within it, the index is kept as a near-tie."""
    tokens = [3, 1]
    logits = torch.zeros(2, 8)
    logits[0, 3] = 1.0
    logits[1, 2] = 1.0               # transformers picks 2, the reference 1: far apart
    with pytest.raises(rec.ExpectedMismatch, match="output index 1: transformers picks 2"):
        rec._hf_near_ties(logits, tokens, NEAR_TIE_EPSILON["float32"])
    logits[1, 1] = 1.0 - 5e-5        # within the epsilon: a near-tie, recorded as such
    assert rec._hf_near_ties(logits, tokens, NEAR_TIE_EPSILON["float32"]) == (1,)


def test_stale_file_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outputs recorded from other fixture files are ignored (the oracle runs the engine)."""
    stale = tmp_path / "stale.json"
    stale.write_text(replace(committed(), fixture_digest="0" * 64).to_json())
    monkeypatch.setattr(exp, "expected_path", lambda model: stale)
    exp.load_expected.cache_clear()
    try:
        assert exp.load_expected(MODEL) is None
    finally:
        exp.load_expected.cache_clear()


def test_recording_one_prompt_agrees_with_the_committed_file() -> None:
    """The record path itself (reference decoding, its scoring, transformers' check) on one
    short prompt gives what was committed."""
    from transformers import LlamaForCausalLM

    from refengine import Engine, EngineConfig
    from refengine.data import resolve_model_dir

    prompt = load_prompt_set("small")[4].ids
    engine = Engine(EngineConfig(model=MODEL, kv_pool_tokens=2048, max_running_requests=1))
    hf = LlamaForCausalLM.from_pretrained(resolve_model_dir(MODEL), dtype=torch.float32).eval()
    tokens = engine.generate([list(prompt)], greedy(16))[0].output_ids
    got = rec.record_one(engine, hf, prompt, tokens, NEAR_TIE_EPSILON["float32"])
    cont = committed().lookup(prompt)
    assert got.tokens == cont.tokens[:16] and got.runner_up == cont.runner_up[:16]
    assert got.margins == pytest.approx(cont.margins[:16], rel=0, abs=exp.MARGIN_TOLERANCE)


def test_a_re_recording_is_judged_by_content_with_margins_within_tolerance() -> None:
    """``specgate expected check``: float noise in the margins is no difference; a moved
    margin beyond the tolerance, or a changed token, is, and is named."""
    base = committed()
    key, cont = next(iter(sorted(base.continuations.items())))

    def with_cont(**change: object) -> exp.ExpectedOutputs:
        return replace(base, continuations={**base.continuations,
                                            key: replace(cont, **change)})

    noisy = tuple(m + exp.MARGIN_TOLERANCE / 2 for m in cont.margins)
    assert exp.differences(base, with_cont(margins=noisy)) == []
    moved = (cont.margins[0] + 3 * exp.MARGIN_TOLERANCE, *cont.margins[1:])
    assert [d for d in exp.differences(base, with_cont(margins=moved))
            if "margin at output index 0" in d and key in d]
    flipped = (cont.runner_up[0], *cont.tokens[1:])
    assert exp.differences(base, with_cont(tokens=flipped)) == [
        f"prompt {key}: tokens, runner-up or near-ties differ"]
