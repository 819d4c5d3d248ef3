"""What a lane's first run costs in a new process: loading (or, on a cold cache, building)
every graph key it meets, beside the same run once its keys are in.

    python benchmarks/first_run.py [--executor aot] [--spec mtp] [--max-new-tokens 64]

For each lane of ``--spec`` (plain decoding and each configuration, the bench's lanes at batch
1), a process of its own opens the reference engine with ``--executor`` and runs the first
default prompt twice: the first run meets every key the lane needs for it (decode or verify,
the draft loops, EAGLE's draft-extend, at each key width the prompt crosses); the second runs
on them. Their difference is what the lane pays to have its keys, and ``builds`` says how
many packages the process compiled (0 on a warm cache: everything was loaded).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from conformance.bench.lanes import lanes_for, load_prompts
from conformance.bench.measure import _run_batch


def child(spec: str, lane_label: str, executor: str, tokens: int) -> dict[str, object]:
    """One lane's two runs, in this process."""
    from conformance.contract import OpenConfig
    from conformance.plan.registry import load_backend
    from refengine.graph import aot_process

    lane = next(ln for ln in lanes_for(spec, ["refengine"]) if ln.label == lane_label)
    start = time.perf_counter()
    handle = load_backend("refengine").open(OpenConfig(spec=lane.spec,
                                                       graph_executor=executor))
    opened = time.perf_counter() - start
    prompt = load_prompts("tiny-code", 1)
    loads = len(aot_process.LOADED)
    runs = []
    for attempt in ("first", "then"):
        start = time.perf_counter()
        _run_batch(handle, prompt, tokens, attempt)  # type: ignore[arg-type]
        runs.append(time.perf_counter() - start)
    runner = handle.engine.runner  # type: ignore[attr-defined]
    builds = len(runner.executor.packages.cache.builds) if executor == "aot" else None
    handle.close()
    return {"lane": lane_label, "open": opened, "first": runs[0], "then": runs[1],
            "packages": len(aot_process.LOADED) - loads, "builds": builds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", default="aot")
    parser.add_argument("--spec", default="mtp")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.spec, args.child, args.executor, args.max_new_tokens)))
        return
    print(f"lane first run in a new process, executor {args.executor}, "
          f"{args.max_new_tokens} tokens (seconds)")
    for lane in lanes_for(args.spec, ["refengine"]):
        out = subprocess.run([sys.executable, __file__, "--child", lane.label, "--spec",
                              args.spec, "--executor", args.executor, "--max-new-tokens",
                              str(args.max_new_tokens)], capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {r['lane']:<20} open {r['open']:.2f}  first run {r['first']:.2f}  then "
              f"{r['then']:.2f}  keys' cost {r['first'] - r['then']:.2f}  packages loaded "
              f"{r['packages']}  built {r['builds']}")


if __name__ == "__main__":
    main()
