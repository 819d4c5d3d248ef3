"""Tier reproducibility: a sampled request's seed decides its tokens, and nothing else does.

* Same seed, same tokens: a seeded request gives one stream alone, in a second engine instance
  opened with another engine seed, and inside a batch of other sampled and greedy requests (at
  another batch position, between sampled requests of other temperature, top-k and top-p
  settings, beside a twin with the same prompt and seed under another request id); under
  plain decoding also after forced retractions. The neighbours' settings differ so that a
  backend handing a request its neighbour's parameters (per-request parameters expanded to
  the wrong per-token rows) draws other tokens: with one setting for all it could not show.
* Top-k alone: the same holds for a seeded request with top-k and no top-p, alone and in a
  batch where no request sets top-p (the batch a backend's top-k-only sampling path serves).
* Different seeds, different streams: requests with one prompt and distinct seeds, in one batch,
  give pairwise different streams.
* Unseeded requests are independent draws: requests with one prompt and no seed, in one batch,
  give pairwise different streams. Nothing is asked of unseeded streams across runs (a backend
  may derive their seeds from the request id, as refengine does, or draw fresh entropy).

Retraction under speculation: a seeded speculative stream depends on where the request's verify
steps start (the token at an output position is drawn by the verify's accept-or-residual
procedure, or plainly by a prefill); a retraction's re-prefill moves them, so the resumed stream
is an equally distributed but different one. That case is checked under plain decoding only.

Chance collisions: two honest streams coincide with probability ``sum_s p(s)^2``, the mean of
``p(s)`` over streams drawn from ``p``. The different-streams checks estimate it from streams the
reference oracle draws from its own exact per-token law at the requested temperature
(``conformance.checks.collisions``), never from the backend's streams (a backend that ignores
temperature and seed would make the likeliest stream look like the model's fault), and require
it below ``MAX_COLLISION`` before reading anything into a coincidence; the estimate is the
check's ``collision_chance`` figure.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from conformance.checks.collisions import collision_probability
from conformance.contract import SamplingParams
from conformance.repro.driver import Outcome
from conformance.run.context import SuiteContext
from conformance.suites.support import greedy, model_property, open_driver, run_all

pytestmark = [pytest.mark.specgate_tier("reproducibility"),
              pytest.mark.specgate_requires("sampling")]

TOKENS = 16
TEMPERATURE = 1.0
PROBE_SEED = 7
STREAMS = 6               # requests per different-streams check
MAX_COLLISION = 1e-6      # estimated chance that two honest streams coincide
# the settings of the probe's sampled batch neighbours, each unlike the probe's (temperature
# 1, no top-k, no top-p) in every parameter it sets
NEIGHBOUR_SETTINGS = ({"temperature": 0.7, "top_k": 4}, {"temperature": 1.3, "top_p": 0.6},
                      {"temperature": 0.5, "top_k": 8, "top_p": 0.8})
# Two settings with top-k and no top-p, unlike each other in both: a batch where no request
# sets top-p is the one a backend may serve by a top-k-only sampling path (a kernel of its own
# in some engines), which the mixed batch above, holding a top-p request, never reaches.
TOP_K_ALONE_SETTINGS = ({"temperature": 0.7, "top_k": 4}, {"temperature": 1.3, "top_k": 8})

Requests = dict[str, tuple[list[int], SamplingParams]]


def sampled(seed: int | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=TOKENS, temperature=TEMPERATURE, ignore_eos=True,
                          seed=seed)


def _run(sg: SuiteContext, requests: Requests, **limits: int) -> dict[str, Outcome]:
    """``requests`` in one fresh engine instance, submitted in order."""
    with open_driver(sg, **limits) as driver:
        return run_all(driver, requests)


def _assert_same(got: dict[str, Outcome], want: list[int], where: str) -> None:
    bad = [f"{rid} from output index {_first_difference(o.output_ids, want)}"
           for rid, o in got.items() if o.output_ids != want]
    assert not bad, f"{where}: the same seed gave different tokens: {bad}"


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                min(len(got), len(want)))


def _assert_pairwise_different(sg: SuiteContext, prompt: list[int], requests: Requests,
                               outcomes: dict[str, Outcome], what: str) -> None:
    streams = {rid: outcomes[rid].output_ids for rid in requests}
    collision = collision_probability(sg.oracle, tuple(prompt), sampled(None))
    sg.extend_property("collision_chance", [f"{collision:.2g}"])
    model_property(sg, collision < MAX_COLLISION,
                   f"two honest streams of this prompt would coincide with probability "
                   f"~{collision:.2g} (below {MAX_COLLISION:g} needed): a coincidence would "
                   "prove nothing")
    same = [(a, b) for a, b in combinations(streams, 2) if streams[a] == streams[b]]
    assert not same, (
        f"{what}: {len(same)} of {len(streams) * (len(streams) - 1) // 2} pairs gave identical "
        f"{TOKENS}-token streams, e.g. {same[:3]} (chance of one such pair ~{collision:.2g})")


@pytest.mark.specgate_requires("seeded_sampling")
def test_seed_fixes_the_stream_whatever_the_batch(sg: SuiteContext) -> None:
    """One seeded request alone, alone in an instance opened with another engine seed, and in a
    batch beside a twin (same prompt and seed, another request id): the same tokens every time.
    In the batch, after a greedy request, the probe and the twin each sit between sampled
    requests of other settings (``NEIGHBOUR_SETTINGS``)."""
    prompt = list(sg.prompts[0].ids)
    alone = _run(sg, {"probe": (prompt, sampled(PROBE_SEED))})["probe"].output_ids
    _assert_same(_run(sg, {"probe": (prompt, sampled(PROBE_SEED))}, seed=1),
                 alone, "another engine instance with another engine seed")
    other = {i: (list(c.ids), replace(sampled(PROBE_SEED + i), **setting))
             for i, (c, setting) in enumerate(zip(sg.prompts[1:4], NEIGHBOUR_SETTINGS,
                                                  strict=True), start=1)}
    requests: Requests = {"greedy": (list(sg.prompts[1].ids), greedy(TOKENS)),
                          "other-1": other[1], "probe": (prompt, sampled(PROBE_SEED)),
                          "other-2": other[2], "twin": (prompt, sampled(PROBE_SEED)),
                          "other-3": other[3]}
    _assert_same({r: o for r, o in _run(sg, requests).items() if r in ("probe", "twin")}, alone,
                 f"in a batch of {len(requests)}, between sampled requests of other settings "
                 "(alone: batch of 1)")


@pytest.mark.specgate_requires("seeded_sampling")
def test_seed_fixes_the_stream_with_top_k_alone(sg: SuiteContext) -> None:
    """A seeded request with top-k and no top-p gives the same tokens alone and in a batch
    where no request sets top-p: after a greedy request, beside a sampled one of another
    temperature and top-k (``TOP_K_ALONE_SETTINGS``). Under speculation its verify steps then
    take the backend's top-k-only path too, rows without drafts included."""
    prompt = list(sg.prompts[0].ids)
    probe = replace(sampled(PROBE_SEED), **TOP_K_ALONE_SETTINGS[0])
    alone = _run(sg, {"probe": (prompt, probe)})["probe"].output_ids
    requests: Requests = {
        "greedy": (list(sg.prompts[1].ids), greedy(TOKENS)),
        "probe": (prompt, probe),
        "other": (list(sg.prompts[2].ids),
                  replace(sampled(PROBE_SEED + 1), **TOP_K_ALONE_SETTINGS[1]))}
    _assert_same({"probe": _run(sg, requests)["probe"]}, alone,
                 f"in a batch of {len(requests)} where no request sets top-p (alone: batch of "
                 "1)")


@pytest.mark.specgate_requires("seeded_sampling", "stepwise", "forced_retract")
def test_seed_fixes_the_stream_across_retraction(sg: SuiteContext) -> None:
    """The middle of three seeded requests is retracted every other step and re-prefilled: it
    resumes with the tokens it would have drawn unretracted (plain decoding only; see the
    module docstring)."""
    if sg.spec.configs[0] is not None:
        pytest.skip("not applicable: a retraction moves where a speculative request's verify "
                    "steps start, and with them its seeded draws")
    prompt = list(sg.prompts[0].ids)
    alone = _run(sg, {"probe": (prompt, sampled(PROBE_SEED))})["probe"].output_ids
    requests: Requests = {"first": (list(sg.prompts[1].ids), sampled(PROBE_SEED + 1)),
                          "probe": (prompt, sampled(PROBE_SEED)),
                          "last": (list(sg.prompts[2].ids), sampled(PROBE_SEED + 2))}
    with open_driver(sg, retract_every=2) as driver:
        outcomes = run_all(driver, requests)
        assert driver.retracted["probe"] > 0, (
            f"precondition: retract_every=2 never retracted the probe in {driver.steps} steps "
            f"(retractions: {dict(driver.retracted)})")
    _assert_same({"probe": outcomes["probe"]}, alone,
                 f"retracted {driver.retracted['probe']} time(s)")


@pytest.mark.specgate_requires("seeded_sampling")
def test_different_seeds_give_different_streams(sg: SuiteContext) -> None:
    prompt = list(sg.prompts[0].ids)
    requests: Requests = {f"seed-{s}": (prompt, sampled(s)) for s in range(1, STREAMS + 1)}
    _assert_pairwise_different(sg, prompt, requests, _run(sg, requests),
                               f"{STREAMS} requests with one prompt and distinct seeds")


def test_unseeded_requests_do_not_collide(sg: SuiteContext) -> None:
    prompt = list(sg.prompts[0].ids)
    requests: Requests = {f"unseeded-{i}": (prompt, sampled(None)) for i in range(STREAMS)}
    _assert_pairwise_different(sg, prompt, requests, _run(sg, requests),
                               f"{STREAMS} unseeded requests with one prompt in one batch")
