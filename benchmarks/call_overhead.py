"""What one call of a compiled key costs beyond its kernels, per executor: a key that does
almost nothing, called with the graph runner's argument list, so the call is all overhead.

    python benchmarks/call_overhead.py [--calls 2000] [--threads 1]

The near-empty forward takes what a decode key takes (two KV pools, the staged views, the row
table: nine tensors) and returns two one-element tensors. Three ways to call it:

* ``eager``: the Python function itself (the floor of any call from Python);
* ``compiled``: ``torch.compile`` as the ``compiled`` and ``frozen`` executors call it (one
  code object per key, guards skipped after the first call: ``graph/compile.py``);
* ``aot``: an AOTInductor package (``graph/aot.py``), its runner called directly.

Each call runs inside a profiler ``record_function`` range, and the profiler's own mean
CPU time of that range is the figure reported (a wall-clock mean is printed beside it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from refengine.graph.aot import AotPackages, PackageCache
from refengine.graph.compile import compiled_call_settings, first_compile_settings, own_code


def near_empty(k_pool: torch.Tensor, v_pool: torch.Tensor, input_ids: torch.Tensor,
               positions: torch.Tensor, out_slots: torch.Tensor, rows: torch.Tensor,
               seq_lens: torch.Tensor, tree_mask: torch.Tensor, table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return k_pool[0, 0, 0, :1] + input_ids[:1], v_pool[0, 0, 0, :1] + seq_lens[:1]


class NearEmpty(torch.nn.Module):
    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return near_empty(*inputs)


def key_inputs() -> list[torch.Tensor]:
    """A decode key's arguments at batch 1 on the tiny fixture's shapes."""
    pool = torch.zeros(2, 4096, 2, 64)
    return [pool, pool.clone(), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
            torch.ones(1, 1, 1, dtype=torch.bool), torch.zeros(8, 256, dtype=torch.int64)]


def callers(inputs: list[torch.Tensor], cache: Path) -> dict[str, Callable[[], object]]:
    compiled = torch.compile(own_code(near_empty), fullgraph=True, dynamic=False)
    with first_compile_settings(), torch.inference_mode():
        compiled(*inputs)
    packages = AotPackages(NearEmpty(), PackageCache(cache, progress=None))
    packages.load("near-empty", "near-empty", NearEmpty, inputs, rows=1)

    def call_compiled() -> object:
        with compiled_call_settings():
            return compiled(*inputs)

    return {"eager": lambda: near_empty(*inputs), "compiled": call_compiled,
            "aot": lambda: packages.run("near-empty", inputs)}


def profiled_mean_us(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(the profiler's mean CPU time of a call's range, the wall-clock mean), microseconds."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            with torch.profiler.record_function("key call"):
                call()
    event = next(e for e in prof.key_averages() if e.key == "key call")
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return event.cpu_time_total / event.count, (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inputs = key_inputs()
    with tempfile.TemporaryDirectory() as cache, torch.inference_mode():
        calls = callers(inputs, Path(cache))
        for call in calls.values():  # warm every path before timing any
            for _ in range(50):
                call()
        figures = {name: [profiled_mean_us(call, args.calls) for _ in range(3)]
                   for name, call in calls.items()}
    print(f"per call, {args.calls} calls x 3 rounds (median of rounds), microseconds")
    for name, rounds in figures.items():
        profiled = statistics.median(r[0] for r in rounds)
        wall = statistics.median(r[1] for r in rounds)
        print(f"  {name:<9} profiler {profiled:7.1f}   wall {wall:7.1f}")


if __name__ == "__main__":
    main()
