"""Torch ops called per engine step in each phase, outside the graph runner's replays, by name.

    python benchmarks/phase_ops.py [--lanes plain,eagle-chain,eagle-tree,mtp-chain,mtp-tree]
                                   [--batch 32] [--tokens 24] [--graphs none|replay]

On a GPU every op the host issues outside a graph costs a dispatch, and most a kernel launch
or a copy: a phase whose op count grows with the batch (an op or two per request) is host work
a graph cannot remove, and the ops between a step's replays are what keeps a graphed step
above its kernels. Counting them needs no GPU: the profiler (CPU activity) records every
top-level ``aten::`` op (not the ops inside another) inside ranges put around the engine's
phases (its clock's: schedule, prefill, decode, draft, verify, extend; and resolve, which in
sequential mode holds the worker's draft-extend) for one batch run to ``--tokens`` new tokens
each, after a warm-up run of the same prompts. With ``--graphs replay`` the ops inside the
executor's run (one graph launch on a GPU) are left out; the staging copies around it count.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from conformance.bench.lanes import ENGINE_LANES, load_prompts, parse_engine_lanes
from refengine import Engine, EngineConfig, SamplingParams
from refengine.clock import PhaseClock
from refengine.events import FinishEvent
from refengine.graph.replay import ReplayExecutor
from refengine.output import OutputProcessor


@contextmanager
def phase_ranges() -> Iterator[None]:
    """Every phase in a profiler range named after it while inside (the clock's phases and
    ``OutputProcessor.resolve``), and each replay in a range named "replay"."""
    timed, resolve, replay = PhaseClock.timed, OutputProcessor.resolve, ReplayExecutor.run

    @contextmanager
    def ranged_phase(self: PhaseClock, phase: str) -> Iterator[None]:
        with record_function(f"phase:{phase}"), timed(self, phase):
            yield

    def ranged_resolve(self: OutputProcessor, *args: Any) -> None:
        with record_function("phase:resolve"):
            resolve(self, *args)

    def ranged_replay(self: ReplayExecutor[Any, Any, Any], *args: Any) -> Any:
        with record_function("replay"):
            return replay(self, *args)

    PhaseClock.timed = ranged_phase  # type: ignore[method-assign]
    OutputProcessor.resolve = ranged_resolve  # type: ignore[method-assign]
    ReplayExecutor.run = ranged_replay  # type: ignore[method-assign]
    try:
        yield
    finally:
        PhaseClock.timed = timed  # type: ignore[method-assign]
        OutputProcessor.resolve = resolve  # type: ignore[method-assign]
        ReplayExecutor.run = replay  # type: ignore[method-assign]


def count(lane: str, batch: int, tokens: int, graphs: bool
          ) -> tuple[int, dict[str, Counter[str]]]:
    """-> (engine steps, per phase the aten ops inside it and outside any replay, by name)
    for one profiled run."""
    engine = Engine(EngineConfig(spec=ENGINE_LANES[lane], max_running_requests=batch,
                                 kv_pool_tokens=32768, cuda_graph=graphs,
                                 graph_executor="replay" if graphs else None))
    prompts = [list(p) for p in load_prompts("tiny-code", batch)]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, [params] * batch)  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps = finished = 0
    with phase_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        while finished < batch:
            finished += sum(isinstance(e, FinishEvent) for e in engine.step())
            steps += 1
    events = prof.events()
    replays = [(e.time_range.start, e.time_range.end) for e in events if e.name == "replay"]
    # Top-level ops only (an op's inner ops, ``to``'s ``copy_``, cost no dispatch of their own
    # from Python), outside any replay.
    outside = [e for e in events if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
               and not any(a <= e.time_range.start and e.time_range.end <= b
                           for a, b in replays)]
    ops: dict[str, Counter[str]] = {}
    for phase in sorted({e.name[6:] for e in events if e.name.startswith("phase:")}):
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.name == f"phase:{phase}"]
        ops[phase] = Counter(e.name for e in outside if any(
            a <= e.time_range.start and e.time_range.end <= b for a, b in spans))
    return steps, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default=",".join(ENGINE_LANES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--graphs", choices=("none", "replay"), default="none")
    args = parser.parse_args()
    try:
        lanes = parse_engine_lanes(args.lanes)
    except ValueError as err:
        parser.error(str(err))
    if args.batch < 1 or args.tokens < 1:
        parser.error("--batch and --tokens: at least 1")
    torch.set_num_threads(1)
    print(f"{'lane':<12}{'phase':<10}{'ops/step':>9}  most frequent (per step)")
    for lane in lanes:
        steps, ops = count(lane, args.batch, args.tokens, args.graphs == "replay")
        for phase, counter in ops.items():
            top = ", ".join(f"{name[6:]} {n / steps:.1f}" for name, n in counter.most_common(4))
            print(f"{lane:<12}{phase:<10}{sum(counter.values()) / steps:>9.1f}  {top}")


if __name__ == "__main__":
    main()
