"""Where one EAGLE chain step's time goes, per worker method and per model forward.

    python benchmarks/step_split.py [--steps 3] [--draft-tokens 4] [--prompts 8]

A plain engine and a chain engine (batch 1, 128 new tokens) take turns prompt by prompt. The
worker's phases (``draft``, ``verify``, ``extend_input``, ``draft_extend``), the KV manager's
``commit_path`` and
every target and head forward are timed in process. Figures are per verify step, except the
per-call forward costs. ``specgate bench`` gives the phase totals; this splits them further.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from conformance.bench.lanes import load_prompts
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig

WORKER_PHASES = ("draft", "verify", "commit_path", "extend_input", "draft_extend")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(obj: object, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            out = inner(*a, **kw)
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
            return out

        setattr(obj, name, wrapper)

    warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = load_prompts("tiny-code", args.prompts)
    plain = Engine(EngineConfig(model="tiny-code", kv_pool_tokens=8192))
    spec = Engine(EngineConfig(model="tiny-code", kv_pool_tokens=8192, spec=SpecConfig(
        draft_model="tiny-code-eagle", num_steps=args.steps, topk=1,
        num_draft_tokens=args.draft_tokens)))
    for engine in (plain, spec):
        engine.generate(prompts[:1], warm)
    worker = spec.worker
    assert worker is not None
    timed(plain.model, "forward", "plain forward")
    timed(spec.model, "forward", "target forward")
    timed(spec.runner, "draft", "head forward")
    for phase in WORKER_PHASES:
        timed(spec.kv if phase == "commit_path" else worker, phase, phase)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    lanes = {"plain": 0.0, "spec": 0.0}
    for prompt in prompts:
        for lane, engine in (("plain", plain), ("spec", spec)):
            start = time.perf_counter()
            engine.generate([prompt], params)
            lanes[lane] += time.perf_counter() - start
    steps = calls["verify"]
    print(f"plain {lanes['plain']:.2f} s, chain S{args.steps}/N{args.draft_tokens} "
          f"{lanes['spec']:.2f} s: speedup {lanes['plain'] / lanes['spec']:.2f}x "
          f"over {steps} verify steps")
    for phase in WORKER_PHASES:
        print(f"  {phase:>13}: {seconds[phase] / steps * 1e3:6.3f} ms per verify step")
    for label in ("plain forward", "target forward", "head forward"):
        print(f"  {label:>14}: {seconds[label] / calls[label] * 1e3:6.3f} ms per call "
              f"({calls[label]} calls, prefills included)")


if __name__ == "__main__":
    main()
