"""EAGLE V2 against V1, with and without the launch thread, side by side in one process.

    python benchmarks/overlap_modes.py [--batch-sizes 1,8,32] [--requests 32] [--repeats 3]

Three engines on the chain S3/N4 configuration: V1, V2 in the deterministic mode
(``overlap_thread=False``) and V2 with the launch thread. Each batch size runs ``--requests``
prompts (8 at batch 1) in groups of that size, greedy, 128 new tokens by default; the lanes
take turns and each keeps its fastest repeat. ``specgate bench --spec eagle-v2`` compares V2
with V1 too, but cannot switch the thread (an engine setting, not a speculative
configuration): this script can.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from conformance.bench.lanes import load_prompts
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = load_prompts("tiny-code", args.requests)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    base = EngineConfig(model="tiny-code", kv_pool_tokens=32768)
    engines = {
        "v1": Engine(replace(base, spec=SpecConfig())),
        "v2 deterministic": Engine(replace(base, spec=SpecConfig(overlap=True),
                                           overlap_thread=False)),
        "v2 thread": Engine(replace(base, spec=SpecConfig(overlap=True), overlap_thread=True)),
    }
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[:1], warm)
    print(f"torch threads {torch.get_num_threads()}, {args.max_new_tokens} new tokens, "
          f"fastest of {args.repeats}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        count = 8 if b == 1 else args.requests
        groups = [prompts[i:i + b] for i in range(0, count, b)]
        best = dict.fromkeys(engines, float("inf"))
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                outs = [o.output_ids for g in groups for o in engine.generate(g, params)]
                best[name] = min(best[name], time.perf_counter() - start)
                outputs[name] = outs
        if len({str(o) for o in outputs.values()}) != 1:
            raise SystemExit(f"batch {b}: the lanes emitted different tokens")
        tokens = count * args.max_new_tokens
        print(f"batch {b:>3}: " + ", ".join(f"{n} {tokens / s:,.1f} tok/s"
                                             for n, s in best.items())
              + f" | v2 deterministic/v1 {best['v1'] / best['v2 deterministic']:.3f}"
              f", v2 thread/v1 {best['v1'] / best['v2 thread']:.3f}")


if __name__ == "__main__":
    main()
