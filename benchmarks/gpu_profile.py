"""Where a decode step's time goes on a GPU: the step's wall time beside the sum of its kernels'
device time, eager and with CUDA graphs, and the wall time split by engine phase.

    python benchmarks/gpu_profile.py [--lanes plain,eagle-chain,mtp-chain] [--batch-sizes 1]
                                     [--tokens 128] [--host-ops N] [--json FILE]

The model is small, so a step is bound by launches and host work, not by the GPU: the sum of
the kernels' device time (``torch.profiler``, CUDA activity, summed per step) is the floor a
step could reach if nothing but its kernels cost time. A lane's gap to that floor is what
launch overhead, host syncs and the engine's Python cost it; CUDA graphs remove most of the
first. Each lane runs unprofiled for its wall time (after a warm-up run that captures every
graph it needs), then once more under the profiler for the kernel sum. The phases are the
engine's own clock (schedule, draft, verify, extend, decode, prefill; "other" is the rest of
the step: resolve and the events) in ms per step. ``--host-ops N`` adds, for each graphed lane
at batch 1, the N host-side ops that cost the most self time per step (a further run profiled
with CPU activity, which slows it: its times are for ranking, not for the step's total).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass

import torch

from conformance.bench.device import kernel_time
from conformance.bench.lanes import (
    ENGINE_LANES,
    load_prompts,
    parse_batch_sizes,
    parse_engine_lanes,
)
from refengine import Engine, EngineConfig, SamplingParams
from refengine.events import FinishEvent, TokenEvent

RIDS = itertools.count()

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
    phase_ms: dict[str, float]  # wall ms per step by engine phase, "other" the rest
    host_ops: list[tuple[str, float, float]]  # (op, self CPU µs per step, calls per step)

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


def host_ops(engine: Engine, prompts: list[tuple[int, ...]], tokens: int, top: int
             ) -> list[tuple[str, float, float]]:
    """The ``top`` host ops by self CPU time per step, from a run profiled with CPU activity."""
    from torch.profiler import ProfilerActivity, profile

    steps: list[int] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps.append(run(engine, prompts, tokens)[1])
    ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / steps[0], e.count / steps[0])
            for e in ranked[:top]]


def measure(lane: str, graphs: bool, batch: int, tokens: int, top_ops: int) -> Profiled:
    engine = Engine(EngineConfig(spec=ENGINE_LANES[lane], device="cuda", cuda_graph=graphs,
                                 max_running_requests=max(batch, 1), kv_pool_tokens=16384))
    prompts = load_prompts("tiny-code", batch)
    run(engine, prompts, tokens)  # warm-up: captures every key this workload replays
    torch.cuda.synchronize()
    before = dict(engine.phase_seconds)
    start = time.perf_counter()
    made, steps = run(engine, prompts, tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    phases = {k: 1e3 * (v - before.get(k, 0.0)) / steps
              for k, v in engine.phase_seconds.items() if v > before.get(k, 0.0)}
    phases["other"] = 1e3 * wall / steps - sum(phases.values())
    profiled: list[int] = []
    device_s, launches = kernel_time(lambda: profiled.append(run(engine, prompts, tokens)[1]),
                                     torch.cuda.synchronize)
    ops = host_ops(engine, prompts, tokens, top_ops) if graphs and batch == 1 and top_ops else []
    return Profiled(lane, graphs, batch, made, steps, wall, made / wall, 1e3 * wall / steps,
                    1e3 * device_s / profiled[0], launches / profiled[0], phases, ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="plain,eagle-chain,mtp-chain")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--host-ops", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        lanes = parse_engine_lanes(args.lanes)
        batches = parse_batch_sizes(args.batch_sizes)
    except ValueError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile: error: needs a CUDA device")
    rows = []
    for batch in batches:
        for lane in lanes:
            for graphs in (False, True):
                rows.append(measure(lane, graphs, batch, args.tokens, args.host_ops))
                print(f"gpu_profile: {lane} {'cuda' if graphs else 'eager'} batch {batch} "
                      "done", flush=True)
    print(f"{'lane':<13}{'graphs':<7}{'b':>3}{'tok/s':>8}{'step ms':>9}{'kernel ms':>10}"
          f"{'floor':>6}{'kernels':>8}  phases (ms per step)")
    for r in rows:
        phases = " ".join(f"{k} {v:.2f}" for k, v in sorted(r.phase_ms.items()))
        print(f"{r.lane:<13}{'cuda' if r.graphs else 'eager':<7}{r.batch:>3}"
              f"{r.tokens_per_s:>8.0f}{r.step_ms:>9.3f}{r.kernel_ms_per_step:>10.3f}"
              f"{100 * r.floor_share:>5.0f}%{r.kernels_per_step:>8.0f}  {phases}")
    for r in rows:
        if r.host_ops:
            print(f"host ops, {r.lane} with graphs at batch 1 (self µs per step, calls per step):")
            for name, us, calls in r.host_ops:
                print(f"  {us:>8.1f} {calls:>6.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "rows": [asdict(r) | {"floor_share": r.floor_share} for r in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
