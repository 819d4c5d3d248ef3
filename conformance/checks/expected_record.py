"""Recording the committed expected outputs (``specgate expected record``).

Recording refuses to write the file unless HF ``LlamaForCausalLM`` in float32, fed the same
prompt and continuation, picks the reference's token at every output index, except where its
own top two logits are within the float32 near-tie epsilon: such indices are stored as
``hf_near_ties``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.checks.expected import (
    PROMPT_SET_TOKENS,
    Continuation,
    ExpectedOutputs,
    fixture_digest,
    prompt_key,
)
from conformance.checks.oracle import NEAR_TIE_EPSILON
from conformance.contract import SamplingParams
from conformance.plan.profiles import PROFILES
from conformance.plan.prompts import load_prompt_set
from conformance.plan.requests import context_limit, requests_across

if TYPE_CHECKING:
    import torch

    from refengine import Engine


class ExpectedMismatch(ValueError):
    """Recording found transformers disagreeing with the reference away from a near-tie."""


def covered_prompts(model: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every prompt the tiers ask greedy outputs of, with the length to record: each prompt of
    the profiles' prompt sets, and each long context the lossless and memory tiers build
    around the profiles' context boundaries."""
    wanted: dict[str, tuple[tuple[int, ...], int]] = {}
    for profile in PROFILES.values():
        for case in load_prompt_set(profile.prompt_set, model):
            wanted[prompt_key(case.ids)] = (case.ids, PROMPT_SET_TOKENS)
    limit = context_limit(model)
    for boundary in sorted({min(b, limit) for p in PROFILES.values()
                            for b in p.context_boundaries}):
        for prompt, params in requests_across(model, boundary).values():
            ids = tuple(prompt)
            wanted[prompt_key(ids)] = (ids, params.max_new_tokens)
    return wanted


def _top2(logits: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
    top = logits.topk(2, dim=-1)
    return (top.indices[:, 0].tolist(), top.indices[:, 1].tolist(),
            (top.values[:, 0] - top.values[:, 1]).tolist())


def _hf_near_ties(hf_logits: torch.Tensor, tokens: list[int], epsilon: float) -> tuple[int, ...]:
    """Output indices where transformers' argmax differs from ``tokens``; ExpectedMismatch if
    any of them is not a near-tie of transformers' own logits."""
    picks = hf_logits.argmax(dim=-1).tolist()
    ties = []
    for i, (pick, token) in enumerate(zip(picks, tokens, strict=True)):
        if pick == token:
            continue
        gap = float(hf_logits[i, pick] - hf_logits[i, token])
        if gap >= epsilon:
            raise ExpectedMismatch(f"output index {i}: transformers picks {pick}, the reference "
                                   f"{token}, {gap:.3g} apart (near-tie epsilon {epsilon:g})")
        ties.append(i)
    return tuple(ties)


def record_one(engine: Engine, hf_model: torch.nn.Module, prompt: tuple[int, ...],
               tokens: list[int], epsilon: float) -> Continuation:
    """``tokens``, the reference's greedy continuation of ``prompt``, with its runner-ups and
    margins from one scoring prefill, checked against transformers fed the same tokens."""
    import torch

    scored = list(prompt) + tokens[:-1]
    logits = engine.prompt_logits(scored)[len(prompt) - 1:]
    top, runner_up, margins = _top2(logits)
    if top != tokens:  # the engine's own scoring must agree with its decoding
        first = next(i for i, (a, b) in enumerate(zip(top, tokens, strict=True)) if a != b)
        raise ExpectedMismatch(f"output index {first}: the reference decodes {tokens[first]} "
                               f"but its scoring prefill ranks {top[first]} first")
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([scored])).logits[0, len(prompt) - 1:].float()
    return Continuation(len(prompt), tuple(tokens), tuple(runner_up), tuple(margins),
                        _hf_near_ties(hf_logits, tokens, epsilon))


def record(model: str) -> ExpectedOutputs:
    """Record every covered prompt's continuation with the reference engine, one request at a
    time as the live oracle decodes, checked against transformers (ExpectedMismatch names the
    first prompt it disagrees on)."""
    import torch
    from transformers import LlamaForCausalLM

    from refengine import Engine, EngineConfig
    from refengine.data import resolve_model_dir

    engine = Engine(EngineConfig(model=model, kv_pool_tokens=8192, max_running_requests=1))
    hf_model = LlamaForCausalLM.from_pretrained(resolve_model_dir(model),
                                                dtype=torch.float32).eval()
    conts = {}
    for key, (prompt, length) in covered_prompts(model).items():
        room = min(length, engine.max_context_len - len(prompt))
        params = SamplingParams(max_new_tokens=room, temperature=0.0, ignore_eos=True)
        tokens = engine.generate([list(prompt)], params)[0].output_ids
        try:
            conts[key] = record_one(engine, hf_model, prompt, tokens,
                                    NEAR_TIE_EPSILON["float32"])
        except ExpectedMismatch as err:
            raise ExpectedMismatch(f"prompt {key} ({len(prompt)} tokens): {err}") from None
    return ExpectedOutputs(model, fixture_digest(model), engine.max_context_len,
                           engine.eos_token_id, conts)
