"""EAGLE V1 in the engine: lossless for chain and tree, every page size, under chunked
prefill, retraction and abort; accept_lens account for every emitted token."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
from engine_helpers import SPEC_GREEDY, SPEC_PROMPTS, SPEC_SHAPES, has_work, spec_engine

from refengine import SamplingParams
from refengine.memory.view import idle_error
from refengine.request import Req
from refengine.speculative.draft_search import beam_search, chain_search
from refengine.speculative.eagle import EagleDrafter
from refengine.speculative.inputs import DraftInput, VerifyInput

PROMPTS, CONFIGS, GREEDY = SPEC_PROMPTS, SPEC_SHAPES, SPEC_GREEDY
engine = spec_engine


@pytest.fixture(scope="module")
def plain_outputs(spec_pair: tuple[Path, Path]) -> list[list[int]]:
    return [o.output_ids for o in engine(spec_pair, None).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_lossless_and_accounted(spec_pair: tuple[Path, Path], plain_outputs: list[list[int]],
                                config: str, page_size: int) -> None:
    e = engine(spec_pair, config, page_size=page_size)
    outs = e.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == plain_outputs
    for o in outs:  # the prefill emits one token; every verify emits accept_lens[i] >= 1
        assert 1 + sum(o.accept_lens) == len(o.output_ids) and min(o.accept_lens) >= 1
    steps = CONFIGS[config][0]
    lens = [n for o in outs for n in o.accept_lens]
    assert max(lens) <= steps + 1
    assert sum(lens) / len(lens) > 1.5, "the mimic head should get drafts accepted"
    assert idle_error(e.memory()) is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_chain_draft_equals_tree_draft_with_topk_1(spec_pair: tuple[Path, Path],
                                                    page_size: int) -> None:
    """The chain fast path is the tree path specialised to ``topk == 1``: on every decode step
    of a mixed-length batch both give the same VerifyInput, field for field, and allocate
    nothing (they draft into the step's reservation)."""
    e = engine(spec_pair, "chain-s3-n4", page_size=page_size)
    worker = e.worker
    assert worker is not None
    batch_sizes: list[int] = []

    drafter = worker.drafter
    assert isinstance(drafter, EagleDrafter)

    def both(reqs: list[Req], din: DraftInput) -> torch.Tensor:
        free = e.kv.allocator.free_slots
        step = worker.draft_step(reqs)
        chain = chain_search(din.topk_index, din.hidden_states, worker.spec.num_steps,
                             drafter.forwards(step, 1))
        beam = beam_search(din.topk_p, din.topk_index, din.hidden_states,
                           worker.spec.num_steps, drafter.forwards(step, 1))
        assert e.kv.allocator.free_slots == free
        roots = drafter.root_tokens(din)
        chain_input = worker.to_verify_input(reqs, roots, chain)
        tree_input = worker.to_verify_input(reqs, roots, beam)
        for f in fields(VerifyInput):  # tensors, and the roots' host copy
            ours, theirs = getattr(chain_input, f.name), getattr(tree_input, f.name)
            assert (torch.equal(ours, theirs) if isinstance(ours, torch.Tensor)
                    else ours == theirs), f.name
        batch_sizes.append(len(reqs))
        return chain

    worker.eager_search = both  # type: ignore[method-assign]
    e.generate(PROMPTS, GREEDY)
    assert max(batch_sizes) == len(PROMPTS) and min(batch_sizes) >= 1


def test_chunked_prefill_keeps_the_draft_chain(spec_pair: tuple[Path, Path]) -> None:
    """Draft KV at a chunk boundary must pair with the next prompt token, not the sampled one:
    chunked and unchunked prefill give the same outputs and the same acceptance."""
    long_prompt = ["def f(a, b):\n    return a + b\n" * 6]
    whole = engine(spec_pair, "chain-s3-n4").generate(long_prompt, GREEDY)[0]
    chunked = engine(spec_pair, "chain-s3-n4", max_prefill_tokens=7).generate(
        long_prompt, GREEDY)[0]
    assert chunked.output_ids == whole.output_ids
    assert chunked.accept_lens == whole.accept_lens


@pytest.mark.parametrize("config", ["chain-s3-n4", "tree-s3-k4-n8"])
def test_forced_retraction_and_aborts(spec_pair: tuple[Path, Path],
                                      plain_outputs: list[list[int]], config: str) -> None:
    e = engine(spec_pair, config, page_size=4, retract_every=2)
    for i, prompt in enumerate(PROMPTS):
        e.add_request(f"r{i}", prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    retracted = 0
    steps = 0
    while has_work(e):
        steps += 1
        if steps == 4:
            e.abort("r2")
        for ev in e.step():
            retracted += type(ev).__name__ == "RetractEvent"
            if type(ev).__name__ == "FinishEvent":
                outputs[ev.rid] = list(ev.output_ids) if ev.reason != "abort" else []
    assert retracted > 0
    for i in range(len(PROMPTS)):
        if i != 2:
            assert outputs[f"r{i}"] == plain_outputs[i], f"r{i}"
    assert idle_error(e.memory()) is None


def test_sampling_is_reproducible_and_mixes_with_greedy(spec_pair: tuple[Path, Path],
                                                        plain_outputs: list[list[int]]) -> None:
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=7,
                             ignore_eos=True)
    params = [sampled, GREEDY, sampled, GREEDY]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3]]
    first = engine(spec_pair, "tree-s3-k4-n8").generate(prompts, params)
    again = engine(spec_pair, "tree-s3-k4-n8").generate(prompts, params)
    assert [o.output_ids for o in first] == [o.output_ids for o in again]
    assert first[0].output_ids == first[2].output_ids  # same seed, same distribution
    assert first[1].output_ids == plain_outputs[1] and first[3].output_ids == plain_outputs[3]


def test_all_finish_inside_verify_then_new_arrivals(spec_pair: tuple[Path, Path],
                                                    plain_outputs: list[list[int]]) -> None:
    e = engine(spec_pair, "chain-s3-n4")
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    assert [o.output_ids for o in e.generate(PROMPTS[:3], short)] == [
        p[:2] for p in plain_outputs[:3]]
    assert e.worker.draft_state.draft_input.batch_size == 0  # idle, installed by the last verify
    assert [o.output_ids for o in e.generate(PROMPTS[3:], GREEDY)] == plain_outputs[3:]


def test_generation_up_to_the_context_limit(spec_pair: tuple[Path, Path]) -> None:
    """Verify blocks and draft scratch run past the context end; the run is cut at it."""
    e = engine(spec_pair, "tree-s5-k8-n16")
    prompt = list(range(5, 5 + e.max_context_len - 10))
    out = e.generate([prompt], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.output_ids) == e.max_context_len
    assert idle_error(e.memory()) is None


def test_draft_refuses_a_request_without_its_reservation(spec_pair: tuple[Path, Path]) -> None:
    """Draft scratch and the verify block are the slots the scheduler reserved past each root;
    a request drafted without that reservation (here: one stray slot past the committed end,
    less than the step's scratch) is refused, never given slots it does not hold."""
    e = engine(spec_pair, "chain-s3-n4")
    e.add_request("a", PROMPTS[0], GREEDY)
    e.step()  # prefill: allocated == committed, a draft input is installed
    (req,) = e._live.values()
    assert e.worker is not None
    assert req.kv_allocated_len == req.kv_committed_len  # V1 holds nothing between steps
    e.kv.extend(req, 1)  # one stray slot past the committed end
    with pytest.raises(RuntimeError, match=r"\['a'\] have no reservation for 2 positions"):
        e.worker.draft([req], e.worker.draft_state.aligned(["a"]))
