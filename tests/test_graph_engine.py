"""``EngineConfig(cuda_graph=True)``: the engine's target decode and verify forwards and its
whole draft steps (EAGLE's loop, Frozen-KV MTP's with the seed folded in) go through the graph
runner, and the tokens, acceptance and seeded samples are the eager engine's, for plain
decoding, EAGLE and MTP V1 chain and tree, and V2, with retraction forced on the way."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from engine_helpers import SPEC_PROMPTS, mtp_engine, spec_engine

from conformance.backends.refengine.graph_probe import RefGraphProbe
from conformance.checks import graph as checks
from refengine import Engine, SamplingParams
from refengine.graph import aot_process
from refengine.graph.aot import CACHE_ENV
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.replay import ReplayExecutor
from refengine.graph.runner import GraphRunner
from refengine.graph.target import GraphKey

# Staggered lengths: the batch shrinks as requests finish, so several buckets replay.
STAGGERED = [SamplingParams(max_new_tokens=6 + 4 * i, ignore_eos=True)
             for i in range(len(SPEC_PROMPTS))]


class CountingReplay(ReplayExecutor):  # type: ignore[type-arg]
    """The replay executor, counting the keys it runs."""

    def __init__(self, runner: GraphRunner) -> None:
        super().__init__(runner.program)
        self.keys: Counter[GraphKey] = Counter()

    def run(self, key: GraphKey, views: object) -> object:  # type: ignore[override]
        self.keys[key] += 1
        return super().run(key, views)  # type: ignore[arg-type]


def count_draft_graphs(runner: GraphRunner, keys: Counter[GraphKey]) -> None:
    """Count the draft loop's, EAGLE's extend graph's and the one-graph step's replays in
    ``keys`` too (kinds "draft:eagle"/"draft:mtp", "extend:eagle", "step:eagle-chain")."""
    for graph in (runner.draft_loop, runner.draft_extend, runner.spec_step):
        if graph is not None:
            count_executes(graph, keys)


def count_executes(graph: DraftLoopGraph, keys: Counter[GraphKey]) -> None:
    execute = graph.execute

    def counted(key: tuple[int, int], views: dict) -> object:
        keys[GraphKey(graph.kind, *key)] += 1
        return execute(key, views)

    graph.execute = counted  # type: ignore[method-assign,assignment]


def count_keys(runner: GraphRunner) -> Counter[GraphKey]:
    """Count every key ``runner`` runs from now on: its executor's and its draft graphs'."""
    keys: Counter[GraphKey] = Counter()
    count_draft_graphs(runner, keys)
    run = runner.executor.run

    def counted_run(key: GraphKey, views: object) -> object:
        keys[key] += 1
        return run(key, views)  # type: ignore[arg-type]

    runner.executor.run = counted_run  # type: ignore[method-assign,assignment]
    return keys


def counted(engine: Engine) -> tuple[Engine, CountingReplay]:
    assert isinstance(engine.runner, GraphRunner)
    counting = CountingReplay(engine.runner)
    engine.runner.executor = counting
    count_draft_graphs(engine.runner, counting.keys)
    return engine, counting


def graph_engine(pair: tuple[Path, Path], config: str | None, overlap: bool = False,
                 **kw: object) -> tuple[Engine, CountingReplay]:
    return counted(spec_engine(pair, config, overlap, cuda_graph=True, graph_executor="replay",
                               max_running_requests=8, **kw))


@pytest.mark.parametrize(("config", "overlap", "kinds"), [
    (None, False, {"decode"}),
    ("chain-s3-n4", False, {"step:eagle-chain"}),  # greedy: every step one graph
    ("tree-s3-k4-n8", False, {"verify", "draft:eagle", "extend:eagle"}),
    ("tree-s3-k4-n8", True, {"verify", "draft:eagle", "extend:eagle"}),
])
@pytest.mark.parametrize("retract_every", [0, 3])
def test_graph_engine_equals_eager(spec_pair: tuple[Path, Path], config: str | None,
                                   overlap: bool, kinds: set[str], retract_every: int) -> None:
    eager = spec_engine(spec_pair, config, overlap, max_running_requests=8,
                        retract_every=retract_every).generate(SPEC_PROMPTS, STAGGERED)
    engine, counting = graph_engine(spec_pair, config, overlap, retract_every=retract_every)
    graphed = engine.generate(SPEC_PROMPTS, STAGGERED)
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    assert [o.accept_lens for o in graphed] == [o.accept_lens for o in eager]
    assert {k.kind for k in counting.keys} == kinds, counting.keys
    assert len({k.bucket for k in counting.keys}) > 1, counting.keys


@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("config", ["chain-s3-n4", "tree-s3-k4-n8"])
def test_mtp_graph_engine_equals_eager(spec_pair: tuple[Path, Path], mtp_dir: Path,
                                       config: str, overlap: bool) -> None:
    """Frozen-KV MTP's folded seed (iteration 0 of the replayed loop, on restaged bonus
    tokens) gives the eager seed-then-loop's drafts: same tokens, same acceptance."""
    eager = mtp_engine(spec_pair, mtp_dir, config, overlap, max_running_requests=8,
                       retract_every=3).generate(SPEC_PROMPTS, STAGGERED)
    engine, counting = counted(mtp_engine(spec_pair, mtp_dir, config, overlap,
                                          max_running_requests=8, retract_every=3,
                                          cuda_graph=True, graph_executor="replay"))
    graphed = engine.generate(SPEC_PROMPTS, STAGGERED)
    assert [o.output_ids for o in graphed] == [o.output_ids for o in eager]
    assert [o.accept_lens for o in graphed] == [o.accept_lens for o in eager]
    one_graph = config.startswith("chain") and not overlap  # greedy: every step one graph
    kind = "step:mtp-chain" if one_graph else "draft:mtp"
    assert {k.kind for k in counting.keys} == ({kind} if one_graph else {"verify", kind}), \
        counting.keys
    assert len({k.bucket for k in counting.keys if k.kind == kind}) > 1, counting.keys


def test_seeded_samples_equal_eager(spec_pair: tuple[Path, Path]) -> None:
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=s,
                             ignore_eos=True) for s in range(len(SPEC_PROMPTS))]
    eager = spec_engine(spec_pair, "tree-s3-k4-n8").generate(SPEC_PROMPTS, params)
    engine, counting = graph_engine(spec_pair, "tree-s3-k4-n8")
    assert [o.output_ids for o in engine.generate(SPEC_PROMPTS, params)] == \
        [o.output_ids for o in eager]
    assert counting.keys


def test_graph_executor_is_validated() -> None:
    from refengine import EngineConfig

    with pytest.raises(ValueError, match=r"^graph_executor: "):
        EngineConfig(cuda_graph=True, graph_executor="tensorrt")  # type: ignore[arg-type]


@pytest.mark.parametrize("executor", ["replay", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize(("algorithm", "config", "kind"), [
    ("eagle", "chain-s3-n4", "draft:eagle"),
    ("eagle", "tree-s3-k4-n8", "draft:eagle"),
    ("eagle", "chain-s3-n4", "extend:eagle"),
    ("eagle", "chain-s3-n4", "step:eagle-chain"),
    ("frozen_kv_mtp", "chain-s3-n4", "draft:mtp"),
    ("frozen_kv_mtp", "chain-s3-n4", "step:mtp-chain"),
    ("frozen_kv_mtp", "tree-s3-k4-n8", "draft:mtp"),
])
def test_draft_loop_kinds_pass_the_graph_properties(spec_pair: tuple[Path, Path],
                                                    mtp_dir: Path, algorithm: str, config: str,
                                                    kind: str, overlap: bool,
                                                    executor: str) -> None:
    """The graph tier's properties for the whole draft step (and EAGLE's draft-extend), on
    every raw size 1..8: graph == the worker's eager search (MTP: its seed step, then the
    loop; extend: the head's eager forward), the padding policy,
    poisoned tails, no history dependence; MTP's leaves the pool byte-identical. V2 (overlap)
    workers draft over the probe requests' decode reservation. Compiled: one inductor compile
    per bucket (slow on a cold cache)."""
    limits = {"cuda_graph": True, "graph_executor": executor, "max_running_requests": 8,
              "page_size": 4}
    engine = (spec_engine(spec_pair, config, overlap, **limits) if algorithm == "eagle"
              else mtp_engine(spec_pair, mtp_dir, config, overlap, **limits))
    probe = RefGraphProbe.for_engine(engine)
    if kind.startswith("step:") and overlap:
        assert kind not in probe.kinds()  # a V2 worker never runs its steps as one graph
        return
    assert kind in probe.kinds() and probe.writes_kv(kind) == (kind != "draft:mtp")
    checks.check_graph_matches_eager(probe, kind, 0)
    checks.check_padding_policy(probe, kind)
    checks.check_poisoned_padding(probe, kind)
    checks.check_no_history_dependence(probe, kind)  # graph == eager above also checks state
    probe.release()


def test_mtp_graph_loop_runs_a_subclassed_assistant(spec_pair: tuple[Path, Path],
                                                    mtp_dir: Path) -> None:
    """The graph loop calls the assistant's own class's forward, also a subclass's that
    overrides it without the inference-mode decorator (the bug zoo's draft that writes KV):
    the loop runs, and that draft's writes show as they do eagerly."""
    from conformance.backends.mutants.speculative import FrozenDraftWritesKV

    def run(graphs: bool) -> list[list[int]]:
        engine = FrozenDraftWritesKV(mtp_engine(
            spec_pair, mtp_dir, "chain-s3-n4", cuda_graph=graphs, graph_executor="replay",
            max_running_requests=8).config)
        return [o.output_ids for o in engine.generate(SPEC_PROMPTS, STAGGERED)]

    assert run(graphs=True) == run(graphs=False)


@pytest.mark.slow
@pytest.mark.parametrize(("executor", "algorithm", "config"), [
    ("frozen", "eagle", "chain-s3-n4"), ("frozen", "frozen_kv_mtp", "chain-s3-n4"),
    ("aot", "eagle", "chain-s3-n4"), ("aot", "frozen_kv_mtp", "chain-s3-n4"),
    ("aot", "eagle", "tree-s3-k4-n8")])
def test_frozen_executors_engine_equals_eager(spec_pair: tuple[Path, Path], mtp_dir: Path,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              executor: str, algorithm: str,
                                              config: str) -> None:
    """The executors that fold the weights into each key (inductor's C++ GEMM templates)
    through a whole engine: the same tokens and acceptance as eager, its verify and draft-loop
    keys used. "frozen" compiles every key in this process; "aot" builds each into a package
    once, and a second engine (a later process, with a bigger pool) loads every one of them,
    the draft loops' included, without building. Hence batch 1 and short outputs."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def engine(**graphs: object) -> Engine:
        limits = {"max_running_requests": 1, **graphs}
        return (spec_engine(spec_pair, config, **limits) if algorithm == "eagle"
                else mtp_engine(spec_pair, mtp_dir, config, **limits))

    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 2
    eager = engine().generate(SPEC_PROMPTS[:2], params)
    want = [(o.output_ids, o.accept_lens) for o in eager]
    one_graph = {"eagle": "step:eagle-chain", "frozen_kv_mtp": "step:mtp-chain"}[algorithm]
    kinds = ({one_graph} if config.startswith("chain")  # greedy: one graph a step
             else {"verify", "draft:eagle", "extend:eagle"} if algorithm == "eagle"
             else {"verify", "draft:mtp"})
    for attempt, pool_tokens in (("first", 4096), ("later", 8192)):
        graphs = engine(cuda_graph=True, graph_executor=executor, kv_pool_tokens=pool_tokens)
        assert isinstance(graphs.runner, GraphRunner) and graphs.runner.executor.name == executor
        keys = count_keys(graphs.runner)
        graphed = graphs.generate(SPEC_PROMPTS[:2], params)
        assert [(o.output_ids, o.accept_lens) for o in graphed] == want
        assert {k.kind for k in keys} == kinds, keys
        if executor != "aot":
            break
        built = graphs.runner.executor.packages.cache.builds
        aot_process.LOADED.clear()  # the later engine stands for a later process: loads from disk
        assert (len(built) == len(keys)) if attempt == "first" else not built, built
