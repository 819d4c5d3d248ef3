"""The hf backend's assisted generation (``draft_model``) against refengine's draft-model
worker on the random tiny Llama: the same drafts (each backend's own forwards of the same
draft), so greedy outputs, seeded sampled outputs and per-verify counts agree exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import build_random_model
from test_hf_backend import run

from conformance.backends.hf import HFHandle, backend
from conformance.backends.refengine import backend as refengine_backend
from conformance.contract import EngineHandle, OpenConfig, Request, SamplingParams, SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [(5, 6, 7, 8), (100, 200, 300), tuple(range(40, 60))]


@pytest.fixture(scope="module", params=["same", "random"])
def spec(request: pytest.FixtureRequest, random_model_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> SpecConfig:
    """The target drafting for itself (every chain accepted: the draft's cache lags by one
    token every step) or an unrelated random draft (mostly rejected)."""
    draft = (random_model_dir if request.param == "same"
             else build_random_model(tmp_path_factory.mktemp("hf-draft") / "d", seed=7))
    return SpecConfig(algorithm="draft_model", draft_model=str(draft), num_steps=3,
                      num_draft_tokens=4)


@pytest.fixture(scope="module")
def pair(random_model_dir: Path, spec: SpecConfig) -> Iterator[tuple[HFHandle, EngineHandle]]:
    cfg = OpenConfig(model=str(random_model_dir), spec=spec)
    hf, ref = backend().open(cfg), refengine_backend().open(cfg)
    yield hf, ref
    hf.close()
    ref.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_assisted_equals_refengine(pair: tuple[HFHandle, EngineHandle],
                                   temperature: float) -> None:
    hf, ref = pair
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=11,
                            ignore_eos=True)
    reqs = [Request(f"p{i}", p, params) for i, p in enumerate(PROMPTS)]
    got, want = run(hf, reqs), run(ref, reqs)
    for r in reqs:
        assert got[r.rid] == want[r.rid], r.rid
        assert got[r.rid].accept_lens and 1 + sum(got[r.rid].accept_lens) == 20


def test_assisted_greedy_equals_plain(pair: tuple[HFHandle, EngineHandle],
                                      random_model_dir: Path, spec: SpecConfig) -> None:
    plain = backend().open(OpenConfig(model=str(random_model_dir)))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reqs = [Request(f"g{i}", p, params) for i, p in enumerate(PROMPTS)]
    got, want = run(pair[0], reqs), run(plain, reqs)
    assert {r: e.output_ids for r, e in got.items()} == {
        r: e.output_ids for r, e in want.items()}
    if spec.draft_model == str(random_model_dir):  # all but the last (cut) verify take all
        assert all(set(e.accept_lens[:-1]) == {4} for e in got.values())


def test_stop_inside_an_accepted_run(pair: tuple[HFHandle, EngineHandle]) -> None:
    """A stop token met inside a run ends it there, on both backends alike."""
    hf, ref = pair
    first = run(ref, [Request("probe", PROMPTS[2], SamplingParams(max_new_tokens=12,
                                                                  ignore_eos=True))])
    stop = first["probe"].output_ids[6]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    reqs = [Request("stop", PROMPTS[2], params)]
    got, want = run(hf, reqs), run(ref, reqs)
    assert got["stop"] == want["stop"] and got["stop"].output_ids[-1] == stop
