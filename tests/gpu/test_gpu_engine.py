"""The reference engine on a CUDA device (every test skips, with the reason, where there is
none; ``tox -e gpu`` runs them on a GPU machine): every algorithm eager and with CUDA graphs,
in float32 (lossless against the CPU float32 reference by the near-tie rule) and bfloat16
(runs to the asked length, KV returned); graphs captured once per key and replayed."""

from __future__ import annotations

import os

import pytest
import torch

from conformance.bench.lanes import ENGINE_LANES
from conformance.checks.oracle import NEAR_TIE_EPSILON, ReferenceOracle
from conformance.plan.specs import SPECS
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.graph.cuda_graph import CudaGraphExecutor, CudaGraphs
from refengine.graph.runner import GraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]


@pytest.fixture(autouse=True, scope="module")
def share_the_cores() -> None:
    """xdist workers share the machine's cores: torch's default (every core in every process)
    had the workers' OpenMP threads spinning against each other on the host-side work (the CPU
    oracle, each step's Python) until a 16-core GPU machine crawled."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The benchmarks' lanes, and every other algorithm and mode.
CASES: dict[str, SpecConfig | None] = {
    **ENGINE_LANES,
    "eagle-v2-chain": SPECS["eagle-v2"].configs[0],
    "eagle-v2-tree": SPECS["eagle-v2"].configs[1],
    "eagle3-chain": SPECS["eagle3"].configs[0],
    "eagle3-tree": SPECS["eagle3-tree"].configs[0],
    "draft-model": SPECS["draft-model"].configs[0],
    "ngram": SPECS["ngram"].configs[0],
    "ngram-v2": SpecConfig(algorithm="ngram", num_steps=3, num_draft_tokens=4, overlap=True),
}
PROMPTS = ["def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):\n    print(i"]
# Staggered lengths: the batch shrinks as requests finish, so several buckets are captured.
PARAMS = [SamplingParams(max_new_tokens=24 + 8 * i, ignore_eos=True) for i in range(4)]


def engine(spec: SpecConfig | None, dtype: str = "float32", graphs: bool = False) -> Engine:
    return Engine(EngineConfig(spec=spec, device="cuda", dtype=dtype, cuda_graph=graphs,
                               max_running_requests=8, kv_pool_tokens=4096,
                               strict_mem_check=True))


@pytest.fixture(scope="module")
def oracle() -> ReferenceOracle:
    return ReferenceOracle("tiny-code")


def assert_on_the_device(e: Engine) -> None:
    """The pools, the row table, the weights and the rotary tables (plain attributes, which a
    module's ``to`` does not move) all on the GPU."""
    assert e.kv.device.type == "cuda" and e.kv.rows.table.device.type == "cuda"
    assert e.model.rotary.cos.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in e.model.parameters())


def assert_all_returned(e: Engine) -> None:
    view = e.memory()
    assert view.free == view.capacity and view.rows_free == view.rows_capacity, view
    assert not view.requests, view


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_on_cuda_is_lossless(oracle: ReferenceOracle, case: str, graphs: bool) -> None:
    e = engine(CASES[case], graphs=graphs)
    assert_on_the_device(e)
    outs = e.generate(PROMPTS, PARAMS)
    for out, params in zip(outs, PARAMS, strict=True):
        assert len(out.output_ids) == params.max_new_tokens
        found = oracle.divergence(tuple(out.prompt_ids), params, out.output_ids,
                                  NEAR_TIE_EPSILON["float32"])
        assert found is None or found.near_tie, found.describe()
    assert_all_returned(e)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_on_cuda_runs(case: str, graphs: bool) -> None:
    e = engine(CASES[case], dtype="bfloat16", graphs=graphs)
    outs = e.generate(PROMPTS, PARAMS)
    for out, params in zip(outs, PARAMS, strict=True):
        assert len(out.output_ids) == params.max_new_tokens
        assert all(0 <= t < e.vocab_size for t in out.output_ids)
    assert_all_returned(e)


@pytest.mark.parametrize("case", ["plain", "eagle-tree", "mtp-chain"])
def test_cuda_graphs_are_captured_once_per_key(case: str) -> None:
    e = engine(CASES[case], graphs=True)
    runner = e.runner
    assert isinstance(runner, GraphRunner) and isinstance(runner.executor, CudaGraphExecutor)
    recorder = runner.executor.graphs
    assert isinstance(recorder, CudaGraphs)
    first = e.generate(PROMPTS, PARAMS)
    captured = recorder.captures
    assert captured > 1  # several buckets (and the draft loops where there are some)
    again = e.generate(PROMPTS, PARAMS)  # the same buckets and widths: replays only
    assert recorder.captures == captured
    assert [o.output_ids for o in again] == [o.output_ids for o in first]


def test_seeded_sampling_on_cuda_is_reproducible() -> None:
    params = [SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=11 + i)
              for i in range(4)]
    spec = CASES["eagle-tree"]
    first = engine(spec, graphs=True).generate(PROMPTS, params)
    second = engine(spec, graphs=True).generate(PROMPTS, params)
    assert [o.output_ids for o in first] == [o.output_ids for o in second]


def test_tree_kernels_on_cuda_are_the_compiled_triton_ones() -> None:
    """The engine's tree build and greedy verify on a CUDA tensor: Triton, compiled (the
    interpreter is never the engine's)."""
    from refengine.kernels.dispatch import tree_kernels
    from refengine.kernels.tree_triton import interpreter_enabled, triton_runnable

    assert triton_runnable() and not interpreter_enabled()
    assert tree_kernels(torch.zeros(2, dtype=torch.int64, device="cuda")) == "triton"
