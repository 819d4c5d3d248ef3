"""How fast the best refengine lane could be if nothing but its kernels cost time, beside
CTranslate2's whole run, on the bench's batch-1 workload, per thread count.

    python benchmarks/kernel_floor.py [--threads 1,2] [--rounds 3] [--spec mtp|eagle]
                                      [--executor aot|frozen|compiled]

Workload: ``specgate bench``'s at batch 1 (the first 8 default prompts one at a time, 64
greedy tokens each, ``ignore_eos``). Every measurement runs in a process of its own, with its
thread count set before anything runs: two OpenMP runtimes in one process starve each
other's threads (CTranslate2 at 2 threads beside torch's 2 ran at about 200 tok/s, against
about 2,000 alone), so ``specgate bench`` can only hold CTranslate2 to one thread. The two
engines take turns (CTranslate2, refengine, CTranslate2) and each keeps its fastest round.

refengine runs its chain S3/N4 lane (MTP by default) through the graph runner (the "aot"
executor by default: a process loads the packages an earlier one built). The outputs of the
two engines are compared prompt by prompt (greedy, so they should be the same tokens). One more run,
under ``cProfile``, splits its time: *kernels* are the calls into compiled code (inductor's
entry points), the KV-write op those call back, and the eager prefill's linear and attention
calls; everything else (staging, scheduling, acceptance, the Python around each call, the
prefill's other ops) is orchestration. The kernel sum is a lower bound on what the lane costs
with its current kernels, however little orchestration is left around them: when it already
exceeds CTranslate2's whole run, no work on orchestration reaches parity; faster kernels (or a
draft with a higher acceptance) would be needed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time

import torch

from conformance.bench.lanes import load_prompts
from conformance.bench.measure import _run_batch
from conformance.contract import OpenConfig, SpecConfig
from conformance.plan.specs import SPECS

PROMPTS, NEW_TOKENS = 8, 64
# Name fragments of the calls counted as kernels (pstats keys: file, line, function).
KERNELS = {"compiled entry points": "inductor_entry_cpp",
           "packages (aot)": "_aoti.run",
           "KV writes (called by them)": "_write_kv",
           "eager linear": "torch._C._nn.linear",
           "eager attention": "scaled_dot_product_attention"}


def run_workload(handle: object, tag: str) -> tuple[float, list[list[int]]]:
    """The workload once on an opened handle -> (wall seconds, each prompt's output)."""
    start = time.perf_counter()
    outputs = [_run_batch(handle, [prompt], NEW_TOKENS, f"{tag}-{i}").outputs[0]  # type: ignore[arg-type]
               for i, prompt in enumerate(load_prompts("tiny-code", PROMPTS))]
    return time.perf_counter() - start, outputs


def lane_spec(spec: str) -> SpecConfig:
    """The chain S3/N4 configuration of ``spec``."""
    return next(c for c in SPECS[spec].configs
                if c is not None and c.topk == 1 and c.num_steps == 3)


def child(engine: str, rounds: int, spec: str, executor: str) -> dict[str, object]:
    """One measurement, in this process (its thread count already set)."""
    from conformance.plan.registry import load_backend  # after the thread count is set
    cfg = (OpenConfig(model="tiny-code") if engine == "ctranslate2" else
           OpenConfig(model="tiny-code", spec=lane_spec(spec), graph_executor=executor))
    handle = load_backend(engine).open(cfg)
    opened = time.perf_counter()
    _, outputs = run_workload(handle, "warm-up")  # a graph lane loads or builds its keys here
    warm_up = time.perf_counter() - opened
    walls = [run_workload(handle, f"round-{r}")[0] for r in range(rounds)]
    result: dict[str, object] = {"wall": min(walls), "walls": walls, "outputs": outputs,
                                 "warm_up": warm_up}
    if engine == "refengine":
        profile = cProfile.Profile()
        profile.enable()
        run_workload(handle, "profiled")
        profile.disable()
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        result["kernels"] = {label: sum(v[2] for k, v in stats.items() if fragment in k[2])
                             for label, fragment in KERNELS.items()}
    handle.close()
    return result


def measure(engine: str, threads: int, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               SPECGATE_CTRANSLATE2_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--child", engine, "--rounds",
                          str(args.rounds), "--spec", args.spec, "--executor", args.executor],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spec", choices=("mtp", "eagle"), default="mtp")
    parser.add_argument("--executor", choices=("aot", "frozen", "compiled"), default="aot")
    parser.add_argument("--child", choices=("ctranslate2", "refengine"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        print(json.dumps(child(args.child, args.rounds, args.spec, args.executor)))
        return
    tokens = PROMPTS * NEW_TOKENS
    lane = f"{args.spec} chain S3/N4 {args.executor}"
    for threads in (int(t) for t in args.threads.split(",")):
        first = measure("ctranslate2", threads, args)
        ref = measure("refengine", threads, args)
        second = measure("ctranslate2", threads, args)
        ct2 = min(float(first["wall"]), float(second["wall"]))  # type: ignore[arg-type]
        wall = float(ref["wall"])  # type: ignore[arg-type]
        kernels: dict[str, float] = ref["kernels"]  # type: ignore[assignment]
        floor = sum(kernels.values())
        print(f"threads {threads}: {tokens} tokens")
        print(f"  ctranslate2 plain      {ct2:.3f} s  {tokens / ct2:8,.1f} tok/s  "
              f"(rounds {first['walls']} then {second['walls']})")
        print(f"  refengine {lane}  {wall:.3f} s  {tokens / wall:8,.1f} tok/s  "
              f"({wall / ct2:.2f}x CTranslate2's time)")
        print(f"  its kernels alone      {floor:.3f} s  {tokens / floor:8,.1f} tok/s  "
              f"({floor / ct2:.2f}x CTranslate2's time): "
              + ", ".join(f"{k} {v:.3f}" for k, v in kernels.items()))
        same = sum(a == b for a, b in zip(ref["outputs"], first["outputs"], strict=True))  # type: ignore[call-overload]
        print(f"  refengine's first pass (keys loaded or built) {ref['warm_up']:.1f} s; "
              f"outputs identical to CTranslate2's on {same} of {PROMPTS} prompts")


if __name__ == "__main__":
    main()
