"""Near-ties: the oracle comparison tolerates a divergence where the reference's top two logits
are closer than the backend's declared precision can resolve, lists it, and fails any other."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from rewriting_backend import RewritingBackend
from test_plugin import run_suite

from conformance.backends.refengine import RefEngineBackend
from conformance.checks.oracle import NEAR_TIE_EPSILON, Divergence, ReferenceOracle, top2_margins
from conformance.contract import FLAG_NAMES, PRECISIONS, Capabilities, Request, SamplingParams
from conformance.run.profiles import PROFILES as PLUGIN_PROFILES
from conformance.run.prompts import load_prompt_set
from refengine import Engine, EngineConfig

pytest_plugins = ["pytester"]

FIXTURE = "tiny-code"
BF16_EPSILON = NEAR_TIE_EPSILON["bfloat16"]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


@cache
def oracle() -> ReferenceOracle:
    return ReferenceOracle(FIXTURE)


@cache
def runner_up(prompt: tuple[int, ...], max_new_tokens: int
              ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per output index of the reference's greedy output: its second-best token and top-2
    margin."""
    want = oracle().greedy(prompt, greedy(max_new_tokens))
    logits = oracle().engine.prompt_logits(list(prompt) + want[:-1])[len(prompt) - 1:]
    return (tuple(int(t) for t in logits.topk(2, dim=-1).indices[:, 1]),
            tuple(float(m) for m in top2_margins(logits)))


def flip_where(fragile: bool):
    """A rewrite that reports the reference's runner-up at the first output index whose top-2
    margin is below the bfloat16 epsilon (``fragile``), or at the first one at least twice it."""
    def rewrite(req: Request, index: int, token: int) -> int:
        second, margins = runner_up(req.prompt_ids, req.params.max_new_tokens)
        chosen = next((i for i, m in enumerate(margins)
                       if (m < BF16_EPSILON if fragile else m >= 2 * BF16_EPSILON)), None)
        return second[index] if index == chosen else token
    return rewrite


def flips_near_ties() -> RewritingBackend:
    return RewritingBackend("flips-near-ties", flip_where(fragile=True), precision="bfloat16")


def flips_confident_tokens() -> RewritingBackend:
    return RewritingBackend("flips-confident", flip_where(fragile=False), precision="bfloat16")


class BFloat16Engine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(replace(config, dtype="bfloat16"))


class BFloat16Reference(RefEngineBackend):
    """The reference engine computing in bfloat16, declaring ``precision``."""

    engine_class = BFloat16Engine

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), precision=self.precision)


def bfloat16_honest() -> BFloat16Reference:
    return BFloat16Reference("bfloat16")


def bfloat16_claiming_float32() -> BFloat16Reference:
    return BFloat16Reference("float32")


def lossless(pytester: pytest.Pytester, backend: str) -> list[dict]:
    (pytester.path / "none.ini").write_text("[pytest]\n")
    _, results = run_suite(pytester, f"tests.test_near_ties:{backend}", Path(FIXTURE),
                           "-k", "test_greedy_matches_reference and chain-s3-n4-batch-1",
                           "--specgate-spec", "eagle", "--specgate-profile", "gate")
    checks = results["checks"]
    assert checks, "no lossless check ran"
    return checks


def test_a_flip_at_a_near_tie_passes_and_is_listed(pytester: pytest.Pytester) -> None:
    """Every request of the batch has its first near-tie flipped: the check passes and lists
    each one, at the flipped index, with the reference's margin there."""
    checks = lossless(pytester, "flips_near_ties")
    assert all(c["outcome"] == "passed" for c in checks), [c["message"] for c in checks]
    ties = [t for c in checks for t in c["figures"].get("near_ties", [])]
    prompts = {c.id: c.ids for c in load_prompt_set(PLUGIN_PROFILES["gate"].prompt_set)}
    tokens = PLUGIN_PROFILES["gate"].max_new_tokens
    expected = 0
    for prompt in prompts.values():
        expected += any(m < BF16_EPSILON for m in runner_up(prompt, tokens)[1])
    assert expected and len(ties) >= expected, f"listed {ties}"
    for tie in ties:
        rid, rest = tie.split("@")
        index, margin = rest.split(" margin=")
        margins = runner_up(prompts[rid.rsplit("-", 1)[0]], tokens)[1]
        first = next(i for i, m in enumerate(margins) if m < BF16_EPSILON)
        assert int(index) == first and float(margin) == pytest.approx(margins[first], rel=1e-2,
                                                                      abs=1e-4), tie


def test_a_flip_at_a_confident_position_fails_naming_it(pytester: pytest.Pytester) -> None:
    checks = lossless(pytester, "flips_confident_tokens")
    assert checks and all(c["outcome"] == "failed" for c in checks)
    message = checks[0]["message"]
    assert "first divergence at output index" in message, message
    assert "reference top-2 margin" in message and "expected" in message, message


@pytest.mark.slow
def test_a_real_bfloat16_engine_passes_only_when_it_says_so(pytester: pytest.Pytester) -> None:
    """Rounding, not a planted flip: in bfloat16 the reference diverges from itself in float32
    at near-ties (about half of the gate's requests within 32 tokens)."""
    honest = lossless(pytester, "bfloat16_honest")
    assert all(c["outcome"] == "passed" for c in honest), [c["message"] for c in honest]
    assert any(c["figures"].get("near_ties") for c in honest)
    claimed = lossless(pytester, "bfloat16_claiming_float32")
    assert all(c["outcome"] == "failed" and "near-tie epsilon 0.0001" in c["message"]
               for c in claimed), [c["message"] for c in claimed]


def test_the_failure_names_position_tokens_and_margin() -> None:
    """The judgment itself, on one prompt: a confident flip fails with its numbers; a flip at
    a near-tie is one; identical outputs are no divergence."""
    prompt = tuple(range(5, 25))
    second, margins = runner_up(prompt, 12)
    params = greedy(12)
    want = oracle().greedy(prompt, params)
    assert oracle().divergence(prompt, params, list(want), BF16_EPSILON) is None
    at = max(range(12), key=lambda i: margins[i])
    got = [*want[:at], second[at], *want[at + 1:]]
    found = oracle().divergence(prompt, params, got, BF16_EPSILON)
    assert found == Divergence(at, second[at], want[at], pytest.approx(margins[at], abs=1e-4),
                               pytest.approx(margins[at], abs=1e-4), BF16_EPSILON)
    assert found.near_tie is (margins[at] < BF16_EPSILON)
    text = found.describe()
    assert (f"output index {at}: got {second[at]}, expected {want[at]}" in text
            and f"margin {margins[at]:.3g}" in text), text


def test_length_differences_are_never_near_ties() -> None:
    prompt = tuple(range(5, 25))
    params = greedy(6)
    want = oracle().greedy(prompt, params)
    short = oracle().divergence(prompt, params, want[:4], BF16_EPSILON)
    long = oracle().divergence(prompt, params, [*want, 7], BF16_EPSILON)
    assert short is not None and not short.near_tie and "got 4 tokens, expected more" in \
        short.describe()
    assert long is not None and not long.near_tie and "got more" in long.describe()


def test_precision_is_declared_not_a_flag() -> None:
    caps = Capabilities(precision="bfloat16")
    assert "precision" not in FLAG_NAMES and "algorithms" not in FLAG_NAMES
    assert caps.as_dict()["precision"] == "bfloat16"
    assert all(isinstance(v, bool) for k, v in caps.as_dict().items()
               if k not in ("algorithms", "precision", "page_multiple"))
    with pytest.raises(ValueError, match="precision"):
        Capabilities(precision="int8")
    with pytest.raises(ValueError, match="unknown capability"):
        caps.claims("precision")
    assert set(NEAR_TIE_EPSILON) == PRECISIONS


def test_margins_match_the_golden_fragility() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.5], [0.0, 0.0, -1.0]])
    assert top2_margins(logits).tolist() == [0.5, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_epsilon_covers_the_references_own_rounding(precision: str) -> None:
    """The reference itself in ``precision``: every change of a top-5 logit gap against its
    float32 logits stays below half the precision's epsilon (the decisions' measurement, on a
    long context)."""

    ids = [t for c in load_prompt_set("default") for t in c.ids][:1500]
    low = Engine(EngineConfig(model=FIXTURE, kv_pool_tokens=4096, dtype=precision))
    exact = oracle().engine.prompt_logits(ids).double()
    rounded = low.prompt_logits(ids).double()
    top = exact.topk(5, dim=-1).indices
    gaps = exact.gather(1, top[:, :1]) - exact.gather(1, top[:, 1:])
    noisy = rounded.gather(1, top[:, :1]) - rounded.gather(1, top[:, 1:])
    worst = float((noisy - gaps).abs().max())
    assert worst < NEAR_TIE_EPSILON[precision] / 2, f"{precision}: worst gap change {worst:.3g}"
