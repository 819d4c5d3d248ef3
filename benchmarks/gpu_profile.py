"""Where a decode step's time goes on a GPU: the step's wall time beside the sum of its kernels'
device time, eager and with CUDA graphs.

    python benchmarks/gpu_profile.py [--lanes plain,eagle-chain,mtp-chain] [--batch 1]
                                     [--tokens 128] [--json FILE]

The model is small, so a step is bound by launches and host work, not by the GPU: the sum of
the kernels' device time (``torch.profiler``, CUDA activity, summed per step) is the floor a
step could reach if nothing but its kernels cost time. A lane's gap to that floor is what
launch overhead, host syncs and the engine's Python cost it; CUDA graphs remove most of the
first. Each lane runs unprofiled for its wall time (after a warm-up run that captures every
graph it needs), then once more under the profiler for the kernel sum.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass

import torch

from conformance.bench.device import kernel_time
from conformance.bench.lanes import load_prompts
from conformance.plan.specs import SPECS
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.events import FinishEvent, TokenEvent

RIDS = itertools.count()

LANES: dict[str, SpecConfig | None] = {
    "plain": None,
    "eagle-chain": SPECS["eagle"].configs[0],
    "eagle-tree": SPECS["eagle-tree"].configs[0],
    "mtp-chain": SPECS["mtp"].configs[0],
}


@dataclass
class Profiled:
    lane: str
    graphs: bool
    batch: int
    tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    step_ms: float
    kernel_ms_per_step: float   # the floor: device time of the step's kernels
    kernels_per_step: float     # launches per step (a graph replay counts its kernels)

    @property
    def floor_share(self) -> float:
        return self.kernel_ms_per_step / self.step_ms


def run(engine: Engine, prompts: list[tuple[int, ...]], tokens: int) -> tuple[int, int]:
    """The prompts to ``tokens`` new tokens each; -> (tokens made, engine steps)."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(f"p{next(RIDS)}", list(prompt), params)
    steps = made = finished = 0
    while finished < len(prompts):
        for event in engine.step():
            made += len(event.token_ids) if isinstance(event, TokenEvent) else 0
            finished += isinstance(event, FinishEvent)
        steps += 1
    return made, steps


def measure(lane: str, graphs: bool, batch: int, tokens: int) -> Profiled:
    engine = Engine(EngineConfig(spec=LANES[lane], device="cuda", cuda_graph=graphs,
                                 max_running_requests=max(batch, 1), kv_pool_tokens=16384))
    prompts = load_prompts("tiny-code", batch)
    run(engine, prompts, tokens)  # warm-up: captures every key this workload replays
    torch.cuda.synchronize()
    start = time.perf_counter()
    made, steps = run(engine, prompts, tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    profiled: list[int] = []
    device_s, launches = kernel_time(lambda: profiled.append(run(engine, prompts, tokens)[1]),
                                     torch.cuda.synchronize)
    return Profiled(lane, graphs, batch, made, steps, wall, made / wall, 1e3 * wall / steps,
                    1e3 * device_s / profiled[0], launches / profiled[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="plain,eagle-chain,mtp-chain")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile: error: needs a CUDA device")
    rows = [measure(lane, graphs, args.batch, args.tokens)
            for lane in args.lanes.split(",") for graphs in (False, True)]
    print(f"{'lane':<14}{'graphs':<8}{'tok/s':>9}{'step ms':>9}{'kernel ms':>11}"
          f"{'floor %':>9}{'kernels':>9}")
    for r in rows:
        print(f"{r.lane:<14}{'cuda' if r.graphs else 'eager':<8}{r.tokens_per_s:>9.0f}"
              f"{r.step_ms:>9.3f}{r.kernel_ms_per_step:>11.3f}{100 * r.floor_share:>8.0f}%"
              f"{r.kernels_per_step:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "rows": [asdict(r) | {"floor_share": r.floor_share} for r in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
