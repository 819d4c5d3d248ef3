"""Acceptance of the bundled EAGLE heads: tau and per-position acceptance on a prompt set.

    python benchmarks/acceptance.py                       # the issue's B2 configurations
    python benchmarks/acceptance.py --config 3,1,4 --config 4,4,10 --max-new-tokens 128
    python benchmarks/acceptance.py --config 3,1,4 --config 3,4,8 \\
        --draft-model tiny-code-eagle --draft-model tiny-code-eagle3    # EAGLE-1 beside EAGLE-3

Each ``--config S,k,N`` is (num_steps, topk, num_draft_tokens); each ``--draft-model`` a head,
run as EAGLE-3 when its config.json names an EAGLE-3 architecture and as EAGLE otherwise. Per
configuration, every head in turn. Greedy, ``ignore_eos``, the whole prompt set in one batch.
tau counts tokens per verify step, bonus included.
"""

from __future__ import annotations

import argparse
import time

from conformance.checks.golden import summarize
from conformance.plan.prompts import load_prompt_set
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.data import resolve_model_dir
from refengine.model.configs import EAGLE3_ARCHITECTURES, architectures
from refengine.model.loader import read_config_json

DEFAULT_CONFIGS = ["3,1,4", "4,4,10"]  # chain N=4 (goal tau >= 2.8), tree S4 k4 N10 (>= 3.2)


def head_algorithm(draft_model: str) -> str:
    """``eagle3`` for a head whose config.json names an EAGLE-3 architecture, else ``eagle``."""
    raw = read_config_json(resolve_model_dir(draft_model))
    return "eagle3" if set(EAGLE3_ARCHITECTURES) & set(architectures(raw)) else "eagle"


def measure(config: SpecConfig, prompt_set: str, max_new_tokens: int, model: str) -> dict:
    cases = load_prompt_set(prompt_set, model)
    engine = Engine(EngineConfig(model=model, spec=config, kv_pool_tokens=65536,
                                 max_running_requests=max(64, len(cases))))
    start = time.perf_counter()
    outs = engine.generate([list(c.ids) for c in cases],
                           SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    stats = summarize([o.accept_lens for o in outs], config.num_steps)
    return {**stats, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="S,k,N (repeatable)")
    parser.add_argument("--prompt-set", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="tiny-code")
    parser.add_argument("--draft-model", action="append",
                        help="an EAGLE or EAGLE-3 head (repeatable; default tiny-code-eagle)")
    args = parser.parse_args()
    heads = {draft: head_algorithm(draft) for draft in args.draft_model or ["tiny-code-eagle"]}
    for text in args.config or DEFAULT_CONFIGS:
        steps, topk, tokens = (int(x) for x in text.split(","))
        for draft, algorithm in heads.items():
            config = SpecConfig(algorithm=algorithm, draft_model=draft, num_steps=steps,
                                topk=topk, num_draft_tokens=tokens)
            r = measure(config, args.prompt_set, args.max_new_tokens, args.model)
            print(f"{draft} ({algorithm}) S={steps} k={topk} N={tokens}: tau {r['mean_tau']}  "
                  f"per-position acceptance {r['per_position_acceptance']}  "
                  f"({r['verify_steps']} verify steps, {r['seconds']} s)")


if __name__ == "__main__":
    main()
