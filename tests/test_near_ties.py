"""Near-ties: the oracle comparison tolerates a divergence where the reference's top two logits
are closer than the backend's declared precision can resolve, lists it, and fails any other.
A reduced precision's bound is calibrated on the reference run in that precision
(``conformance.checks.calibration``): the reference in bfloat16 passes, the reference in
bfloat16 with every logit up to 0.45 off fails, and each check says how many tokens it compared."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from rewriting_backend import RewritingBackend
from test_plugin import run_suite

from conformance.backends.refengine import RefEngineBackend
from conformance.checks.calibration import (
    CALIBRATION_FACTOR,
    Calibration,
    calibrate,
    reference_calibration,
    resolution,
)
from conformance.checks.oracle import NEAR_TIE_EPSILON, Divergence, ReferenceOracle, top2_margins
from conformance.contract import FLAG_NAMES, PRECISIONS, Capabilities, Request, SamplingParams
from conformance.plan.profiles import PROFILES as PLUGIN_PROFILES
from conformance.plan.prompts import load_prompt_set
from conformance.plan.requests import calibration_requests
from refengine import Engine, EngineConfig
from refengine.model.llama import ForwardBatch, ForwardOutput
from refengine.runner import ModelRunner

pytest_plugins = ["pytester"]

FIXTURE = "tiny-code"
NOISE = 0.45  # the noisy backend's logits: up to this far off, either way


@cache
def calibrated(precision: str) -> Calibration:
    """What the gate's checks judge a ``precision`` backend's near-ties by."""
    return reference_calibration(FIXTURE, precision,
                                 calibration_requests(FIXTURE, PLUGIN_PROFILES["gate"]))


def bf16_allowance() -> float:
    return calibrated("bfloat16").allowance


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
    margin is below the bfloat16 allowance (``fragile``), or at the first one at least twice
    it."""
    def rewrite(req: Request, index: int, token: int) -> int:
        second, margins = runner_up(req.prompt_ids, req.params.max_new_tokens)
        bound = bf16_allowance()
        chosen = next((i for i, m in enumerate(margins)
                       if (m < bound if fragile else m >= 2 * bound)), None)
        return second[index] if index == chosen else token
    return rewrite


def flips_near_ties() -> RewritingBackend:
    return RewritingBackend("flips-near-ties", flip_where(fragile=True), precision="bfloat16")


def flips_confident_tokens() -> RewritingBackend:
    return RewritingBackend("flips-confident", flip_where(fragile=False), precision="bfloat16")


class BFloat16Engine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(replace(config, dtype="bfloat16"))


class NoisyRunner(ModelRunner):
    """Adds uniform noise in [-NOISE, NOISE] to every logit of every forward (one seeded
    generator per engine: the same noise every run)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        out = super().forward(batch)
        noise = (torch.rand(out.logits.shape, generator=self.noise) * 2 - 1) * NOISE
        return replace(out, logits=out.logits + noise.to(out.logits))


class NoisyBFloat16Engine(BFloat16Engine):
    runner_class = NoisyRunner


class Float16Engine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(replace(config, dtype="float16"))


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


class NoisyBFloat16(BFloat16Reference):
    """The reference in bfloat16 with every logit off by up to ``NOISE``, declaring
    bfloat16: not a rounding, a broken model."""

    engine_class = NoisyBFloat16Engine


def bfloat16_with_noise() -> NoisyBFloat16:
    return NoisyBFloat16("bfloat16")


class Float16Reference(BFloat16Reference):
    """The reference engine computing in float16, declaring it."""

    engine_class = Float16Engine


def float16_honest() -> Float16Reference:
    return Float16Reference("float16")


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
        expected += any(m < bf16_allowance() for m in runner_up(prompt, tokens)[1])
    assert expected and len(ties) >= expected, f"listed {ties}"
    for tie in ties:
        rid, rest = tie.split("@")
        index, margin = rest.split(" margin=")
        margins = runner_up(prompts[rid.rsplit("-", 1)[0]], tokens)[1]
        first = next(i for i, m in enumerate(margins) if m < bf16_allowance())
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
    assert oracle().divergence(prompt, params, list(want), bf16_allowance()) is None
    at = max(range(12), key=lambda i: margins[i])
    got = [*want[:at], second[at], *want[at + 1:]]
    found = oracle().divergence(prompt, params, got, bf16_allowance())
    assert found == Divergence(at, second[at], want[at], pytest.approx(margins[at], abs=1e-4),
                               pytest.approx(margins[at], abs=1e-4), bf16_allowance())
    assert found.near_tie is (margins[at] < bf16_allowance())
    text = found.describe()
    assert (f"output index {at}: got {second[at]}, expected {want[at]}" in text
            and f"margin {margins[at]:.3g}" in text), text


def test_length_differences_are_never_near_ties() -> None:
    prompt = tuple(range(5, 25))
    params = greedy(6)
    want = oracle().greedy(prompt, params)
    short = oracle().divergence(prompt, params, want[:4], bf16_allowance())
    long = oracle().divergence(prompt, params, [*want, 7], bf16_allowance())
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


def test_the_allowance_is_twice_the_larger_of_margin_and_resolution() -> None:
    assert resolution("bfloat16", 9.5) == 2.0 ** -4 and resolution("float16", 9.5) == 2.0 ** -7
    assert resolution("bfloat16", 16.0) == 2.0 ** -3
    measured = Calibration("bfloat16", 100, 3, largest_margin=0.2, resolution=0.0625)
    assert measured.allowance == pytest.approx(CALIBRATION_FACTOR * 0.2)
    unseen = Calibration("float16", 100, 0, largest_margin=0.0, resolution=2.0 ** -7)
    assert unseen.allowance == CALIBRATION_FACTOR * 2.0 ** -7
    wild = Calibration("bfloat16", 100, 3, largest_margin=5.0, resolution=0.0625)
    assert wild.allowance == NEAR_TIE_EPSILON["bfloat16"]  # never past the ceiling
    assert "0.4" in measured.describe() and "3 of 100" in measured.describe()
    with pytest.raises(ValueError, match="a reduced one"):
        calibrate(oracle(), "float32", ())  # float32 has its fixed epsilon


def test_the_gate_calibrates_on_the_reference_itself() -> None:
    """On the gate's calibration requests the reference in bfloat16 leaves float32 at a few
    positions, the largest margin setting the allowance well under the old flat 1.0; in
    float16 at none, one unit of its rounding setting it."""
    bf16, fp16 = calibrated("bfloat16"), calibrated("float16")
    requests = calibration_requests(FIXTURE, PLUGIN_PROFILES["gate"])
    assert bf16.positions == fp16.positions == sum(
        len(oracle().greedy(p, params)) for p, params in requests)
    assert bf16.divergences > 0 and bf16.largest_margin > bf16.resolution
    assert bf16.allowance == CALIBRATION_FACTOR * bf16.largest_margin < 1.0
    assert fp16.divergences == 0 and fp16.allowance == CALIBRATION_FACTOR * fp16.resolution


def gate_checks(pytester: pytest.Pytester, backend: str) -> dict[str, dict]:
    """One batch and the to-limit request of the gate's lossless tier, plain decoding."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    _, results = run_suite(pytester, f"tests.test_near_ties:{backend}", Path(FIXTURE),
                           "-k", "plain-batch-1 or plain-ctx2048-no-retract",
                           "--specgate-spec", "none", "--specgate-profile", "gate")
    return {c["nodeid"].split("::")[-1]: c for c in results["checks"]
            if c["nodeid"].startswith("test_lossless.py")}


@pytest.mark.parametrize(("backend", "diverges"), [("bfloat16_honest", True),
                                                   ("float16_honest", False)])
def test_the_reference_in_reduced_precision_passes(pytester: pytest.Pytester, backend: str,
                                                   diverges: bool) -> None:
    """Rounding only: every divergence is within the calibrated allowance. Each check says how
    many tokens it compared (of the reference's): in bfloat16 fewer than all, the rest past a
    listed near-tie; in float16 the batch never leaves the reference."""
    checks = gate_checks(pytester, backend)
    assert set(checks) == {"test_greedy_matches_reference[plain-batch-1]",
                           "test_past_context_boundary[plain-ctx2048-no-retract]"}, checks
    assert all(c["outcome"] == "passed" for c in checks.values()), checks
    batch = checks["test_greedy_matches_reference[plain-batch-1]"]["figures"]
    compared, total = batch["tokens_compared"][0].split(",")[0].split("/")
    assert int(total) == 16 * PLUGIN_PROFILES["gate"].max_new_tokens
    assert (int(compared) < int(total)) is diverges, batch
    assert bool(batch.get("near_ties")) is diverges, batch


def test_a_noisy_bfloat16_backend_fails(pytester: pytest.Pytester) -> None:
    """Every logit up to 0.45 off: it leaves the reference where the reference's margin is
    past anything its own bfloat16 rounding does (under the old flat 1.0, a near-tie)."""
    checks = gate_checks(pytester, "bfloat16_with_noise")
    batch = checks["test_greedy_matches_reference[plain-batch-1]"]
    assert batch["outcome"] == "failed", checks
    assert "first divergence" in batch["message"] and (
        f"near-tie epsilon {bf16_allowance():g}" in batch["message"]), batch["message"]
