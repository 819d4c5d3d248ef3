"""Acceptance A2: on the trained ``tiny-code`` fixture, refengine's greedy output equals
``transformers`` greedy ``generate`` token for token on every default prompt (64 new tokens,
EOS ignored), run one request at a time and all at once, and the logits agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import LogitsRecorder, drive, hf_greedy, max_logit_diff

from refengine import Engine, EngineConfig, SamplingParams
from refengine.data import resolve_model_dir
from refengine.memory.view import idle_error

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "tiny-code"
PROMPTS_FILE = REPO / "fixtures" / "prompts" / "default.jsonl"
NEW_TOKENS = 64
LOGITS_TOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)

PROMPTS: list[tuple[str, str]] = [
    (row["id"], row["text"])
    for row in (json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line)
]
Reference = dict[str, tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(FIXTURE)  # also checks every file against MANIFEST.json


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    # Default pool (16384 slots) holds every prompt plus 64 new tokens at once (~7.2k).
    return Engine(EngineConfig(model=FIXTURE))


@pytest.fixture(scope="module")
def prompt_ids(engine: Engine) -> dict[str, list[int]]:
    return {pid: engine.tokenize(text) for pid, text in PROMPTS}


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompt_ids: dict[str, list[int]]) -> Reference:
    """transformers (float32) greedy tokens and per-step logits for every prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {pid: hf_greedy(hf, ids, NEW_TOKENS) for pid, ids in prompt_ids.items()}


def compare(pid: str, ours: list[int], ours_logits: list[torch.Tensor],
            reference: Reference) -> str | None:
    """A one-line description of the first disagreement, or None."""
    tokens, logits = reference[pid]
    if ours != tokens:
        at = next(i for i, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b)
        return f"{pid}: token {at} differs (refengine {ours[at]}, transformers {tokens[at]})"
    first = float((ours_logits[0] - logits[0]).abs().max())
    if first >= LOGITS_TOL:
        return f"{pid}: last-position logits differ by {first:.2e}"
    every = max_logit_diff(ours_logits, logits)
    if every >= LOGITS_TOL:
        return f"{pid}: logits of a later step differ by {every:.2e}"
    return None


def test_prompt_set(prompt_ids: dict[str, list[int]], engine: Engine) -> None:
    assert len(PROMPTS) == 40
    assert len({pid for pid, _ in PROMPTS}) == len(PROMPTS)
    assert all(0 < len(ids) < engine.max_context_len - NEW_TOKENS for ids in prompt_ids.values())


def test_next_token_logits_match_transformers(engine: Engine,
                                             prompt_ids: dict[str, list[int]],
                                             reference: Reference) -> None:
    worst = max(float((engine.next_token_logits(ids) - reference[pid][1][0]).abs().max())
                for pid, ids in prompt_ids.items())
    assert worst < LOGITS_TOL
    assert idle_error(engine.memory()) is None


def test_matches_transformers_one_at_a_time(engine: Engine, prompt_ids: dict[str, list[int]],
                                            reference: Reference) -> None:
    recorder = LogitsRecorder(engine)
    try:
        problems = []
        for pid, ids in prompt_ids.items():
            engine.add_request(pid, ids, GREEDY)
            run = drive(engine, recorder)
            assert run.finishes[pid].reason == "length"
            problems.append(compare(pid, run.tokens[pid], run.logits[pid], reference))
            assert idle_error(engine.memory()) is None
    finally:
        engine.runner.target = recorder.inner
    assert [p for p in problems if p] == []


def test_matches_transformers_all_at_once(engine: Engine, prompt_ids: dict[str, list[int]],
                                          reference: Reference) -> None:
    recorder = LogitsRecorder(engine)
    try:
        for pid, ids in prompt_ids.items():
            engine.add_request(pid, ids, GREEDY)
        run = drive(engine, recorder)
    finally:
        engine.runner.target = recorder.inner
    assert run.retractions == 0
    problems = [compare(pid, run.tokens[pid], run.logits[pid], reference) for pid in prompt_ids]
    assert [p for p in problems if p] == []
    assert idle_error(engine.memory()) is None
