"""Draft-model speculation in the engine: greedy output equals plain decoding (N=4 and N=6,
page 1 and 4), the draft's proposals are its own greedy continuation (so its catch-up after a
fully accepted chain is right), sampling is reproducible beside greedy rows, retraction every
3 steps and an abort leave nothing behind, and bad configurations fail before any work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import build_random_model
from engine_helpers import SPEC_GREEDY, SPEC_PROMPTS, drive

from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.memory.view import idle_error
from refengine.request import Req
from refengine.speculative.inputs import CatchUpInput, VerifyInput


@pytest.fixture(scope="module")
def drafts(spec_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """``same``: the target itself (every chain is accepted, so every step leaves the last
    draft token behind); ``random``: an unrelated two-layer Llama (mixed acceptance)."""
    root = tmp_path_factory.mktemp("draft-model")
    return {"same": spec_pair[0], "random": build_random_model(root / "random", seed=5)}


def draft_engine(target: Path, draft: Path, n: int = 4, **kw: object) -> Engine:
    spec = SpecConfig(algorithm="draft_model", draft_model=str(draft), num_steps=n - 1,
                      num_draft_tokens=n)
    return Engine(EngineConfig(model=str(target), spec=spec,
                               **{"kv_pool_tokens": 4096, "strict_mem_check": True, **kw}))


@pytest.fixture(scope="module")
def plain(spec_pair: tuple[Path, Path]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(spec_pair[0]), kv_pool_tokens=4096))
    return [o.output_ids for o in engine.generate(SPEC_PROMPTS, SPEC_GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("n", [4, 6])
@pytest.mark.parametrize("which", ["same", "random"])
def test_greedy_equals_plain(spec_pair: tuple[Path, Path], drafts: dict[str, Path],
                             plain: list[list[int]], which: str, n: int,
                             page_size: int) -> None:
    engine = draft_engine(spec_pair[0], drafts[which], n, page_size=page_size)
    outs = engine.generate(SPEC_PROMPTS, SPEC_GREEDY)
    assert [o.output_ids for o in outs] == plain
    for o in outs:
        assert 1 + sum(o.accept_lens) == len(o.output_ids)
        assert min(o.accept_lens) >= 1 and max(o.accept_lens) <= n
        if which == "same":  # the target drafting for itself: every chain but the cut last
            assert set(o.accept_lens[:-1]) == {n}, o.accept_lens
    assert idle_error(engine.memory()) is None


@pytest.mark.parametrize("which", ["same", "random"])
def test_draft_proposes_its_own_greedy_continuation(spec_pair: tuple[Path, Path],
                                                    drafts: dict[str, Path],
                                                    which: str) -> None:
    """Whatever was accepted before (a fully accepted chain leaves one position of draft KV
    to catch up: every step of ``same``), the step's drafts are what the draft model alone
    would generate from the request's tokens: its KV covers the committed prefix."""
    engine = draft_engine(spec_pair[0], drafts[which])
    seen: list[tuple[list[int], list[int], int]] = []
    draft = engine.worker.draft  # type: ignore[union-attr]

    def recording(reqs: list[Req], din: CatchUpInput) -> VerifyInput:
        vin = draft(reqs, din)
        seen.extend((list(r.fill_ids), vin.draft_tokens[i, 1:].tolist(), int(din.behind[i]))
                    for i, r in enumerate(reqs))
        return vin

    engine.worker.draft = recording  # type: ignore[union-attr, method-assign]
    engine.generate(SPEC_PROMPTS[:2], SPEC_GREEDY)
    if which == "same":
        assert [b for _, _, b in seen[2:]] == [1] * (len(seen) - 2)
    alone = Engine(EngineConfig(model=str(drafts[which]), kv_pool_tokens=4096))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for context, proposed, _ in seen[::3]:
        assert alone.generate([context], params)[0].output_ids == proposed


def test_sampling_is_reproducible_and_mixes_with_greedy(spec_pair: tuple[Path, Path],
                                                        drafts: dict[str, Path],
                                                        plain: list[list[int]]) -> None:
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7,
                             ignore_eos=True)
    params = [sampled, SPEC_GREEDY, sampled, SPEC_GREEDY]
    prompts = [SPEC_PROMPTS[0], SPEC_PROMPTS[1], SPEC_PROMPTS[0], SPEC_PROMPTS[3]]
    first = draft_engine(spec_pair[0], drafts["same"]).generate(prompts, params)
    again = draft_engine(spec_pair[0], drafts["same"]).generate(prompts, params)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert first[0].output_ids == first[2].output_ids  # same seed, same distribution
    assert first[1].output_ids == plain[1] and first[3].output_ids == plain[3]


@pytest.mark.parametrize("which", ["same", "random"])
def test_retraction_every_3_steps_and_abort(spec_pair: tuple[Path, Path],
                                            drafts: dict[str, Path], plain: list[list[int]],
                                            which: str) -> None:
    """Retraction frees the draft's KV with the target's (one allocator): the strict check
    holds after every step, the pool is whole at the end, survivors match plain decoding."""
    engine = draft_engine(spec_pair[0], drafts[which], page_size=4, retract_every=3)
    for i, prompt in enumerate(SPEC_PROMPTS):
        engine.add_request(f"r{i}", prompt, SPEC_GREEDY)
    run = drive(engine, before_step=lambda step: engine.abort("r2") if step == 4 else None)
    assert run.retractions > 0
    assert run.finishes["r2"].reason == "abort"
    for i, expected in enumerate(plain):
        if i != 2:
            assert list(run.finishes[f"r{i}"].output_ids) == expected, f"r{i}"
    assert idle_error(engine.memory()) is None
    assert engine.worker.draft_state.rids == []  # type: ignore[union-attr]


def test_all_finish_inside_verify_installs_an_idle_state(spec_pair: tuple[Path, Path],
                                                         drafts: dict[str, Path],
                                                         plain: list[list[int]]) -> None:
    engine = draft_engine(spec_pair[0], drafts["same"])
    short = SamplingParams(max_new_tokens=3, ignore_eos=True)
    assert [o.output_ids for o in engine.generate(SPEC_PROMPTS[:3], short)] == [
        p[:3] for p in plain[:3]]
    state = engine.worker.draft_state.draft_input  # type: ignore[union-attr]
    assert isinstance(state, CatchUpInput) and state.batch_size == 0
    assert [o.output_ids for o in engine.generate(SPEC_PROMPTS[3:], SPEC_GREEDY)] == plain[3:]


def test_draft_kv_lives_in_its_own_pool(spec_pair: tuple[Path, Path],
                                        drafts: dict[str, Path]) -> None:
    engine = draft_engine(spec_pair[0], drafts["random"])
    pool = engine.kv.draft_pool
    assert pool is not None and pool.k.shape[0] == 2  # the random draft's two layers
    engine.generate(SPEC_PROMPTS[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert pool.k.abs().sum() > 0


@pytest.mark.parametrize(("field", "change"), [("topk", {"topk": 2, "num_draft_tokens": 4}),
                                               ("overlap", {"overlap": True})])
def test_config_refuses_trees_and_overlap(field: str, change: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{field}: draft_model"):
        SpecConfig(algorithm="draft_model", draft_model="tiny-code-draft", num_steps=3,
                   **{"num_draft_tokens": 4, **change})  # type: ignore[arg-type]


def test_loader_refuses_an_eagle_head(spec_pair: tuple[Path, Path], tmp_path: Path) -> None:
    head = tmp_path / "head"
    shutil.copytree(spec_pair[1], head)
    shutil.copy(spec_pair[0] / "tokenizer.json", head / "tokenizer.json")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        draft_engine(spec_pair[0], head)


def test_graph_replay_engine_matches(spec_pair: tuple[Path, Path], drafts: dict[str, Path],
                                     plain: list[list[int]]) -> None:
    """Under the graph runner the target's decode and verify replay; the draft stays eager."""
    engine = draft_engine(spec_pair[0], drafts["random"], cuda_graph=True,
                          graph_executor="replay", max_running_requests=8)
    assert engine.runner.draft_loop is None
    assert [o.output_ids for o in engine.generate(SPEC_PROMPTS, SPEC_GREEDY)] == plain
