"""EAGLE-3 through the whole engine, on the bundled ``tiny-code`` and ``tiny-code-eagle3``:
chains and trees, sequential (V1) and overlap (V2) scheduling, with retraction forced, give
plain decoding's tokens with drafts accepted; every graph executor gives the eager engine's
tokens and acceptance, through the verify, draft-loop and draft-extend graphs (the target's
verify graph computes the head's fused taps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.graph import aot_process
from refengine.graph.aot import CACHE_ENV
from refengine.graph.runner import GraphRunner
from tests.test_graph_engine import count_keys

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(",
           "class Stack:\n    def __init__(self):\n", "for i in range(10):\n    print(",
           "# Read a file and count its lines\n"]
# Staggered lengths: the batch shrinks as requests finish, so several buckets run.
PARAMS = [SamplingParams(max_new_tokens=12 + 6 * i, ignore_eos=True) for i in range(len(PROMPTS))]
SHAPES = {"chain-s3-n4": (3, 1, 4), "tree-s3-k4-n8": (3, 4, 8)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def eagle3_engine(shape: str, overlap: bool = False, **kw: object) -> Engine:
    steps, topk, tokens = SHAPES[shape]
    spec = SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle3", num_steps=steps,
                      topk=topk, num_draft_tokens=tokens, overlap=overlap)
    return Engine(EngineConfig(spec=spec, **{"kv_pool_tokens": 4096,
                                             "max_running_requests": 8, **kw}))


def run(engine: Engine, n: int = len(PROMPTS)) -> list[tuple[list[int], list[int]]]:
    return [(o.output_ids, o.accept_lens) for o in engine.generate(PROMPTS[:n], PARAMS[:n])]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o.output_ids for o in Engine(EngineConfig()).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("overlap", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_eagle3_is_lossless_and_drafts(plain: list[list[int]], shape: str,
                                       overlap: bool) -> None:
    out = run(eagle3_engine(shape, overlap, retract_every=3))
    assert [tokens for tokens, _ in out] == plain
    accepted = [n for _, lens in out for n in lens]
    assert max(accepted) == SHAPES[shape][0] + 1, accepted  # a whole draft accepted somewhere
    assert sum(accepted) / len(accepted) > 1.5, accepted


@pytest.mark.parametrize(("executor", "shape", "overlap"), [
    ("replay", "chain-s3-n4", False), ("replay", "tree-s3-k4-n8", True),
    pytest.param("compiled", "chain-s3-n4", True, marks=pytest.mark.slow),
    pytest.param("aot", "chain-s3-n4", False, marks=pytest.mark.slow),
    pytest.param("aot", "tree-s3-k4-n8", False, marks=pytest.mark.slow)])
def test_eagle3_graphs_equal_eager(executor: str, shape: str, overlap: bool, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 1 under the executors that compile each key (their builds dominate)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    n = len(PROMPTS) if executor == "replay" else 2
    limits = {} if executor == "replay" else {"max_running_requests": 1}
    want = run(eagle3_engine(shape, overlap, **limits), n)
    graphs = eagle3_engine(shape, overlap, cuda_graph=True, graph_executor=executor, **limits)
    assert isinstance(graphs.runner, GraphRunner)
    keys = count_keys(graphs.runner)
    assert run(graphs, n) == want
    kinds = ({"step:eagle-chain"} if shape.startswith("chain") and not overlap  # greedy
             else {"verify", "draft:eagle", "extend:eagle"})
    assert {k.kind for k in keys} == kinds, keys
    aot_process.LOADED.clear()  # packages of this test's cache only
