"""The CUDA-graph executor's logic on the CPU: capture once per key, restage every input before
each replay, copy every replay's outputs out (the graphs share one memory pool), for the
target's kinds and the draft loops. ``EmulatedGraphs`` stands in for the recording, with a
graph's contract (static outputs overwritten in place by the next replay, inputs read at
replay); ``tests/gpu/`` runs the same engine paths with real CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import SPEC_PROMPTS, mtp_engine, spec_engine

from refengine import Engine, EngineConfig, SamplingParams
from refengine.graph.cuda_graph import CudaGraphExecutor, CudaGraphs, EmulatedGraphs
from refengine.graph.program import copy_out
from refengine.graph.runner import GraphRunner, TargetExecutor
from refengine.graph.target import GraphKey
from refengine.speculative.draft_search import Candidates

STAGGERED = [SamplingParams(max_new_tokens=6 + 4 * i, ignore_eos=True)
             for i in range(len(SPEC_PROMPTS))]


class EmulatedCudaRunner(GraphRunner):
    """The graph runner with its "replay" executor swapped for the CUDA-graph executor on the
    emulated recorder: the draft loops then take the "cuda" path too, on the same recorder."""

    def executor_for(self, name: str) -> TargetExecutor:
        assert name == "replay"
        return CudaGraphExecutor(self.program, EmulatedGraphs())


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Engine, "graph_runner_class", EmulatedCudaRunner)


def recorder(engine: Engine) -> EmulatedGraphs:
    assert isinstance(engine.runner, GraphRunner)
    executor = engine.runner.executor
    assert isinstance(executor, CudaGraphExecutor) and isinstance(executor.graphs,
                                                                  EmulatedGraphs)
    return executor.graphs


def captured_keys(engine: Engine) -> int:
    assert isinstance(engine.runner, GraphRunner)
    executor = engine.runner.executor
    assert isinstance(executor, CudaGraphExecutor)
    loops = [g for g in (engine.runner.draft_loop, engine.runner.draft_extend,
                         engine.runner.spec_step) if g is not None]
    loop_executors = [loop.executor for loop in loops]
    for loop_executor in loop_executors:  # siblings: the target's recorder, the same pool
        assert isinstance(loop_executor, CudaGraphExecutor)
        assert loop_executor.graphs is executor.graphs
    return len(executor.keyed.captured) + sum(len(e.keyed.captured) for e in loop_executors
                                              if isinstance(e, CudaGraphExecutor))


@pytest.mark.parametrize(("config", "overlap"), [
    (None, False), ("chain-s3-n4", False), ("tree-s3-k4-n8", False), ("tree-s3-k4-n8", True)],
    ids=["plain", "eagle-chain", "eagle-tree", "eagle-tree-v2"])
def test_emulated_cuda_graphs_equal_eager(spec_pair: tuple[Path, Path], emulated: None,
                                          config: str | None, overlap: bool) -> None:
    eager = spec_engine(spec_pair, config, overlap, max_running_requests=8,
                        retract_every=3).generate(SPEC_PROMPTS, STAGGERED)
    engine = spec_engine(spec_pair, config, overlap, max_running_requests=8, retract_every=3,
                         cuda_graph=True, graph_executor="replay")
    graphed = engine.generate(SPEC_PROMPTS, STAGGERED)
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    assert [o.accept_lens for o in graphed] == [o.accept_lens for o in eager]
    # Each key recorded once, whatever how many steps replayed it: several buckets here.
    keys = captured_keys(engine)
    assert recorder(engine).captures == keys and keys > 1


@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
def test_emulated_cuda_mtp_loop_equals_eager(spec_pair: tuple[Path, Path], mtp_dir: Path,
                                             emulated: None, overlap: bool) -> None:
    """Frozen-KV MTP's loop with the seed folded in: its bonus tokens restaged every replay."""
    eager = mtp_engine(spec_pair, mtp_dir, "chain-s3-n4", overlap, max_running_requests=8,
                       retract_every=3).generate(SPEC_PROMPTS, STAGGERED)
    engine = mtp_engine(spec_pair, mtp_dir, "chain-s3-n4", overlap, max_running_requests=8,
                        retract_every=3, cuda_graph=True, graph_executor="replay")
    graphed = engine.generate(SPEC_PROMPTS, STAGGERED)
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    assert [o.accept_lens for o in graphed] == [o.accept_lens for o in eager]
    assert recorder(engine).captures == captured_keys(engine)


def test_runner_hands_out_copies_of_a_replays_outputs(spec_pair: tuple[Path, Path],
                                                      emulated: None) -> None:
    """A replay overwrites the static outputs in place; what ``forward`` returned for an earlier
    step must not change with it."""
    engine = spec_engine(spec_pair, None, False, max_running_requests=8, cuda_graph=True,
                         graph_executor="replay")
    runner = engine.runner
    assert isinstance(runner, GraphRunner) and isinstance(runner.executor, CudaGraphExecutor)
    key = GraphKey("decode", 1, runner.kv_sizes[0])
    views = runner.staging["decode"].stage(None, 1)
    first = runner.executor.run(key, views)
    kept = first.logits.clone()
    views.input_ids.fill_(7)  # another step's token, restaged into the same buffer
    second = runner.executor.run(key, views)
    assert second.logits is first.logits  # static outputs: the same tensor, overwritten
    assert not torch.equal(second.logits, kept)  # ... with the new step's values
    assert runner.executor.outputs_persist  # so the runner copies them out


def test_copy_out_keeps_the_structure() -> None:
    found = Candidates(torch.rand(2, 3), torch.arange(6).view(2, 3), torch.zeros(2, 3,
                                                                             dtype=torch.int64))
    copy = copy_out((found, torch.ones(2)))
    assert isinstance(copy, tuple) and isinstance(copy[0], Candidates)
    assert torch.equal(copy[0].tokens, found.tokens)
    assert copy[0].tokens.data_ptr() != found.tokens.data_ptr()


def test_cuda_graphs_need_a_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"^graph_executor: 'cuda' needs a CUDA device"):
        CudaGraphs("cpu")
    with pytest.raises(ValueError, match=r"^graph_executor: 'cuda' \(CUDA graphs\) needs"):
        EngineConfig(cuda_graph=True, graph_executor="cuda")


def test_default_graph_executor_follows_the_device() -> None:
    assert EngineConfig().graph_executor == "aot"
    assert EngineConfig(device="cuda").graph_executor == "cuda"
    assert EngineConfig(device="cuda:1", graph_executor="replay").graph_executor == "replay"
    with pytest.raises(ValueError, match=r"^graph_executor: 'frozen' folds"):
        EngineConfig(device="cuda", graph_executor="frozen")


def test_launch_thread_leaves_new_keys_to_the_engines_thread(spec_pair: tuple[Path, Path],
                                                             emulated: None) -> None:
    """Under overlap scheduling with its launch thread, a key first needed there runs eagerly
    and is queued; the engine captures the queue on its own thread before the next launch
    (the emulated recorder refuses a capture anywhere else, as a GPU capture beside the
    resolving thread's work failed)."""
    engine = spec_engine(spec_pair, "chain-s3-n4", True, max_running_requests=8,
                         cuda_graph=True, graph_executor="replay", overlap_thread=True)
    runner = engine.runner
    assert engine._launcher is not None and isinstance(runner, GraphRunner)
    assert isinstance(runner.executor, CudaGraphExecutor)
    loops = [g for g in (runner.draft_loop, runner.draft_extend, runner.spec_step)
             if g is not None]
    queued: list[int] = []
    capture_pending = runner.capture_pending

    def counting() -> None:
        pending = [runner.executor.keyed.pending,
                   *(g.executor.keyed.pending for g in loops
                     if isinstance(g.executor, CudaGraphExecutor))]
        queued.append(sum(len(p) for p in pending))
        capture_pending()
        assert not any(pending)

    runner.capture_pending = counting  # type: ignore[method-assign]
    eager = spec_engine(spec_pair, "chain-s3-n4", True, max_running_requests=8,
                        overlap_thread=False).generate(SPEC_PROMPTS, STAGGERED)
    graphed = engine.generate(SPEC_PROMPTS, STAGGERED)
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    assert max(queued) > 0 and recorder(engine).captures == captured_keys(engine)
