"""Host work per engine step per request on the CPU: a step's wall time minus the time spent in
its kernels (torch ops and AOT package calls), divided by the requests the step carried.

    python benchmarks/host_overhead.py [--lanes plain,eagle-chain,mtp-chain]
                                       [--batch-sizes 1,8,32] [--graphs none|replay|aot]
                                       [--tokens 64] [--repeats 2] [--json FILE]

Everything outside a kernel is the engine's own cost: scheduling, staging a step's inputs, the
accept walk, the KV commit, output processing, and the Python between ops inside a forward. On a
GPU that work is what keeps a graphed step above its kernels' device time; on the CPU it is
measured the same way without a device. Each lane runs once unmeasured (warm-up: first uses,
compiled keys), then ``repeats`` times: a timed run for the wall time, then the same run under
the profiler (CPU activity only) for the kernel time, so the profiler's own cost per op stays
out of the wall time (it lands in the kernel intervals if anywhere: host time is, if anything,
under-stated). The figure is the smallest of the repeats. Kernel time is the union of the
intervals of every ``aten::`` op and every package call (this script wraps
``AotPackages.run`` in a profiler range), so nested ops count once.

``--phases`` adds where the host time goes, from the profiled run of the best repeat: per
engine phase (``phase_ops.py``'s ranges: schedule, prefill, decode, draft, verify, extend,
resolve; "other" for the rest of a step) the range's time outside kernels, each moment
counted in its innermost phase. The profiler's own cost per op inflates these, so they
split the host figure rather than add up to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from phase_ops import phase_ranges  # this directory's sibling script (sys.path[0])

from conformance.bench.lanes import (
    ENGINE_LANES,
    load_prompts,
    parse_batch_sizes,
    parse_engine_lanes,
)
from refengine import Engine, EngineConfig, SamplingParams
from refengine.events import FinishEvent, TokenEvent

RIDS = itertools.count()
PACKAGE_RANGE = "aot package call"
STEP_RANGE = "engine step"

@dataclass
class HostCost:
    lane: str
    graphs: str
    batch: int
    steps: int
    tokens: int
    wall_ms_per_step: float
    kernel_ms_per_step: float
    host_us_per_step_per_request: float
    # Host µs per step per request by phase, from the profiled run (``--phases``).
    phase_host_us: dict[str, float] = field(default_factory=dict)


def run(engine: Engine, prompts: list[tuple[int, ...]], tokens: int, ranged: bool = False
        ) -> tuple[int, int]:
    """The prompts to ``tokens`` new tokens each, all admitted at once; -> (tokens, steps).
    ``ranged``: each step in a profiler range (``STEP_RANGE``)."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(f"h{next(RIDS)}", list(prompt), params)
    steps = made = finished = 0
    while finished < len(prompts):
        with torch.profiler.record_function(STEP_RANGE) if ranged else nullcontext():
            events = engine.step()
        for event in events:
            made += len(event.token_ids) if isinstance(event, TokenEvent) else 0
            finished += isinstance(event, FinishEvent)
        steps += 1
    return made, steps


Span = tuple[float, float]


def kernel_spans(events: Any) -> list[Span]:
    """The CPU intervals of every op and package call among ``events``, merged and sorted."""
    merged: list[Span] = []
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events
                              if e.name.startswith("aten::") or e.name == PACKAGE_RANGE):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def covered(spans: list[Span], start: float, stop: float) -> float:
    """How much of ``[start, stop]`` the merged ``spans`` cover."""
    return sum(max(0.0, min(b, stop) - max(a, start)) for a, b in spans)


def kernel_seconds(events: Any) -> float:
    """The union of the CPU intervals of every op and package call among ``events``."""
    return sum(b - a for a, b in kernel_spans(events)) / 1e6  # the profiler's µs


def phase_host_seconds(events: Any) -> dict[str, float]:
    """Per phase, the time its ranges spend outside kernels, each moment in its innermost
    phase; "other": a step's time outside every phase and kernel."""
    kernels = kernel_spans(events)
    phases = sorted(((e.time_range.start, e.time_range.end, e.name[6:]) for e in events
                     if e.name.startswith("phase:")), key=lambda p: (p[0], -p[1]))
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_RANGE]

    def host(start: float, stop: float) -> float:
        return stop - start - covered(kernels, start, stop)

    seconds: dict[str, float] = {}
    for i, (start, stop, name) in enumerate(phases):
        inner = [p for p in phases[i + 1:] if p[0] < stop and p[1] <= stop]
        # Only the outermost of the phases inside (they may nest again) is subtracted.
        outermost = [p for p in inner if not any(q is not p and q[0] <= p[0] and p[1] <= q[1]
                                                 for q in inner)]
        own = host(start, stop) - sum(host(a, b) for a, b, _ in outermost)
        seconds[name] = seconds.get(name, 0.0) + own / 1e6
    top = [p for p in phases if not any(q is not p and q[0] <= p[0] and p[1] <= q[1]
                                        for q in phases)]
    seconds["other"] = (sum(host(a, b) for a, b in steps)
                        - sum(host(a, b) for a, b, _ in top)) / 1e6
    return seconds


def measure(lane: str, graphs: str, batch: int, tokens: int, repeats: int, phases: bool
            ) -> HostCost:
    engine = Engine(EngineConfig(spec=ENGINE_LANES[lane], max_running_requests=batch,
                                 cuda_graph=graphs != "none",
                                 graph_executor=None if graphs == "none" else graphs,
                                 kv_pool_tokens=16384))
    prompts = load_prompts("tiny-code", batch)
    run(engine, prompts, tokens)  # warm-up: every key and shape this workload uses
    best: HostCost | None = None
    for _ in range(repeats):
        start = time.perf_counter()
        made, steps = run(engine, prompts, tokens)
        wall = time.perf_counter() - start
        with (phase_ranges() if phases else nullcontext(),
              torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof):
            again = run(engine, prompts, tokens, ranged=phases)
        assert again == (made, steps), f"{lane} batch {batch}: the profiled run differs"
        events = prof.events()
        kernels = kernel_seconds(events)
        split = ({name: round(sec / steps / batch * 1e6, 1)
                  for name, sec in phase_host_seconds(events).items()} if phases else {})
        cost = HostCost(lane, graphs, batch, steps, made, round(wall / steps * 1e3, 3),
                        round(kernels / steps * 1e3, 3),
                        round(max(wall - kernels, 0.0) / steps / batch * 1e6, 1), split)
        if best is None or cost.host_us_per_step_per_request < best.host_us_per_step_per_request:
            best = cost
    assert best is not None
    return best


def wrap_package_calls() -> None:
    """Put every AOT package call in a profiler range, so its kernels count as kernel time."""
    from refengine.graph.aot import AotPackages

    inner = AotPackages.run

    def timed(self: AotPackages, key: Any, inputs: Any) -> list[torch.Tensor]:
        with torch.profiler.record_function(PACKAGE_RANGE):
            return inner(self, key, inputs)

    AotPackages.run = timed  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="plain,eagle-chain,mtp-chain")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--graphs", default="none", choices=("none", "replay", "aot"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phases", action="store_true",
                        help="also split the host time by engine phase (profiled run)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    try:
        lanes = parse_engine_lanes(args.lanes)
        sizes = parse_batch_sizes(args.batch_sizes)
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(args.threads)
    wrap_package_calls()
    rows: list[HostCost] = []
    print(f"{'lane':>12} {'graphs':>6} {'batch':>5} {'steps':>5} {'step ms':>8} "
          f"{'kernel ms':>9} {'host us/step/req':>16}")
    for lane in lanes:
        for batch in sizes:
            row = measure(lane, args.graphs, batch, args.tokens, args.repeats, args.phases)
            rows.append(row)
            print(f"{row.lane:>12} {row.graphs:>6} {row.batch:>5} {row.steps:>5} "
                  f"{row.wall_ms_per_step:>8.3f} {row.kernel_ms_per_step:>9.3f} "
                  f"{row.host_us_per_step_per_request:>16.1f}", flush=True)
            if row.phase_host_us:
                print("    host us/step/req by phase (profiled): " + ", ".join(
                    f"{k} {v:.0f}" for k, v in sorted(row.phase_host_us.items(),
                                                      key=lambda kv: -kv[1])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "tokens": args.tokens,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
