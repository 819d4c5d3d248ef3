"""Frozen-KV MTP in the engine: greedy output equals plain decoding (V1 and V2, chain and tree,
page 1 and 4, batch and one at a time, forced retraction); the draft writes no KV and takes no
slots; when every request finishes inside verify the next arrivals still merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import SPEC_GREEDY, SPEC_PROMPTS, drive, mtp_engine

from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.runner import ModelRunner
from refengine.speculative.inputs import SeedInput

SHAPES = ["chain-s3-n4", "tree-s3-k4-n8"]


@pytest.fixture(scope="module")
def plain(spec_pair: tuple[Path, Path], mtp_dir: Path) -> list[list[int]]:
    engine = mtp_engine(spec_pair, mtp_dir, None)
    return [o.output_ids for o in engine.generate(SPEC_PROMPTS, SPEC_GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("config", SHAPES)
def test_mtp_greedy_equals_plain(spec_pair: tuple[Path, Path], mtp_dir: Path,
                                 plain: list[list[int]], config: str, overlap: bool,
                                 page_size: int) -> None:
    engine = mtp_engine(spec_pair, mtp_dir, config, overlap, page_size=page_size)
    batch = engine.generate(SPEC_PROMPTS, SPEC_GREEDY)
    assert [o.output_ids for o in batch] == plain
    assert all(o.accept_lens and min(o.accept_lens) >= 1 for o in batch)
    alone = [engine.generate([p], SPEC_GREEDY)[0].output_ids for p in SPEC_PROMPTS[:2]]
    assert alone == plain[:2]


@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
def test_mtp_under_forced_retraction(spec_pair: tuple[Path, Path], mtp_dir: Path,
                                     plain: list[list[int]], overlap: bool) -> None:
    engine = mtp_engine(spec_pair, mtp_dir, "tree-s3-k4-n8", overlap, retract_every=3,
                        page_size=4)
    for i, prompt in enumerate(SPEC_PROMPTS):
        engine.add_request(f"r{i}", prompt, SPEC_GREEDY)
    run = drive(engine)
    assert run.retractions > 0
    assert [run.finishes[f"r{i}"].output_ids for i in range(len(SPEC_PROMPTS))] == [
        tuple(p) for p in plain]


def test_frozen_draft_writes_no_kv_and_takes_no_slots(spec_pair: tuple[Path, Path],
                                                      mtp_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Around every draft forward: the KV pool is byte-identical and the allocator untouched."""
    engine = mtp_engine(spec_pair, mtp_dir, "tree-s3-k4-n8")
    calls: list[int] = []
    inner = ModelRunner.forward_frozen_draft

    def watched(runner: ModelRunner, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        k, v = runner.kv.target_pool.k.clone(), runner.kv.target_pool.v.clone()
        free = runner.kv.allocator.backup_state()
        out = inner(runner, *args, **kw)  # type: ignore[arg-type]
        assert torch.equal(k, runner.kv.target_pool.k) and torch.equal(v, runner.kv.target_pool.v)
        assert runner.kv.allocator.backup_state() == free
        calls.append(1)
        return out

    monkeypatch.setattr(ModelRunner, "forward_frozen_draft", watched)
    engine.generate(SPEC_PROMPTS[:3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert calls, "the frozen draft never ran"
    assert engine.kv.draft_pool is None


def test_all_finish_in_verify_installs_an_idle_seed(spec_pair: tuple[Path, Path],
                                                    mtp_dir: Path) -> None:
    engine = mtp_engine(spec_pair, mtp_dir, "chain-s3-n4")
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate(SPEC_PROMPTS[:3], short)
    state = engine.worker.draft_state  # type: ignore[union-attr]
    assert isinstance(state.draft_input, SeedInput) and state.draft_input.batch_size == 0
    again = engine.generate(SPEC_PROMPTS[:3], SPEC_GREEDY)
    assert all(len(o.output_ids) == SPEC_GREEDY.max_new_tokens for o in again)


def test_mtp_loader_refuses_an_eagle_head(spec_pair: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="FrozenKVMTPAssistant"):
        Engine(EngineConfig(model=str(spec_pair[0]), spec=SpecConfig(
            algorithm="frozen_kv_mtp", draft_model=str(spec_pair[1]))))
