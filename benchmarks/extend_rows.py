"""Draft-extend cost with the row-restricted head against the whole layer on every row.

    python benchmarks/extend_rows.py [--prompts 16] [--rounds 2] [--max-new-tokens 128]

One engine (chain S3/N4, batch 1); the two variants take turns prompt by prompt, and each
``SpeculativeWorker.draft_extend`` call is timed. The "all rows" variant runs the head's decoder
layer with no ``keep`` and selects the wanted rows afterwards, which is what the head did
before it took ``keep``. Outputs must be identical (they are greedy and the draft only
proposes); the script stops otherwise.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from conformance.bench.lanes import load_prompts
from refengine import Engine, EngineConfig, SamplingParams, SpecConfig
from refengine.model.eagle import EagleDraftModel
from refengine.model.llama import ForwardBatch, KVCache
from refengine.request import Req
from refengine.speculative.inputs import DraftExtendInput, DraftInput

KEEP_ROWS = EagleDraftModel.forward


@torch.inference_mode()
def all_rows(self: EagleDraftModel, batch: ForwardBatch, features: torch.Tensor, kv: KVCache
             ) -> tuple[torch.Tensor, torch.Tensor]:
    x = self.fuse(batch.input_ids, features)
    x = self.layer(x, self.rotary.at(batch.positions, x.dtype), batch.attention,
                   batch.out_slots, kv)
    return self.predict(batch.wanted(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model="tiny-code", kv_pool_tokens=8192, spec=SpecConfig(
        draft_model="tiny-code-eagle", num_steps=3, topk=1, num_draft_tokens=4)))
    worker = engine.worker
    assert worker is not None
    extend: Callable[[list[Req], DraftExtendInput], DraftInput] = worker.draft_extend
    variants = {"keep rows": KEEP_ROWS, "all rows": all_rows}
    seconds = dict.fromkeys(variants, 0.0)
    calls = dict.fromkeys(variants, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in variants}
    current = ["keep rows"]

    def timed(reqs: list[Req], ext: DraftExtendInput) -> DraftInput:
        start = time.perf_counter()
        out = extend(reqs, ext)
        seconds[current[0]] += time.perf_counter() - start
        calls[current[0]] += 1
        return out

    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    prompts = load_prompts("tiny-code", args.prompts)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    worker.draft_extend = timed  # type: ignore[method-assign]
    try:
        for _ in range(args.rounds):
            for prompt in prompts:
                for name, forward in variants.items():
                    current[0] = name
                    EagleDraftModel.forward = forward  # type: ignore[method-assign]
                    outputs[name].append(engine.generate([prompt], params)[0].output_ids)
    finally:
        EagleDraftModel.forward = KEEP_ROWS  # type: ignore[method-assign]
    if outputs["keep rows"] != outputs["all rows"]:
        raise SystemExit("outputs differ between the two variants")
    for name in variants:
        print(f"{name}: draft_extend {seconds[name] / calls[name] * 1e3:.3f} ms per call "
              f"({calls[name]} calls)")


if __name__ == "__main__":
    main()
