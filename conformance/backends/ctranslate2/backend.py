"""CTranslate2 as a backend: a C++ inference engine, plain decoding run to completion.

A worked example of certifying an engine specgate's authors did not write (docs/adapter.md,
"Worked example"). The fixture's HF Llama directory is converted once with CTranslate2's
transformers converter (float32) into a cache keyed by the directory's content, then decoded
by ``ctranslate2.Generator.generate_batch``. Finish semantics are refengine's
(``conformance/contract/finish.py``), applied token by token in the generation callback:
CTranslate2's own end tokens are switched off (``end_token=[]``) and the callback stops a row
the moment its ``FinishRule`` says so, so EOS, stop tokens, stop strings and the length limit
finish exactly where refengine finishes.

What it does not claim, and why, is in ``UNCLAIMED_REASONS`` (shown on the certificate).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from itertools import groupby
from pathlib import Path

import ctranslate2
import torch
from tokenizers import Tokenizer

from conformance.backends.ctranslate2.convert import COMPUTE_TYPE, converted_model_dir
from conformance.backends.queued import QueuedHandle, QueuedJob
from conformance.contract import (
    Capabilities,
    OpenConfig,
    Request,
)
from conformance.contract.finish import FinishRule, eos_token_id
from refengine.data import resolve_model_dir

if importlib.util.find_spec("transformers") is None:  # the converter needs it; say so at load
    raise ImportError("the ctranslate2 backend converts HF models with transformers, which is "
                      "not installed")

NAME = "ctranslate2"

_NO_SPECULATION = "CTranslate2's Generator has no speculative decoding (no draft, no verify)"
UNCLAIMED_REASONS = {
    **{f"algorithm:{a}": _NO_SPECULATION
       for a in ("eagle", "eagle3", "frozen_kv_mtp", "draft_model", "ngram")},
    **{flag: _NO_SPECULATION for flag in ("tree", "acceptance_stats", "reference_draft",
                                          "worker_hooks")},
    "kernels": "CTranslate2 exposes no tree-building or verify kernels (it has no speculation)",
    "stepwise": "generate_batch runs a batch to completion in one call: nothing can be added "
                "or observed between decoding steps",
    "abort": "requests run to completion inside one step(): there is no moment to abort one",
    "overlap": "one generate_batch call at a time: no step is launched before the last resolves",
    "in_flight": "one generate_batch call at a time: no step is ever left in flight",
    "seeded_sampling": "CTranslate2 has one process-wide random seed (set_random_seed): a "
                       "request's own seed cannot fix its draws, so seeded sampled requests "
                       "are refused",
    "sampling": "the sampled-token law is certified with requests differing only in their "
                "seed, which CTranslate2 cannot honour (unseeded sampled requests run, "
                "drawing from the process-wide generator, uncertified)",
    "memory_view": "CTranslate2 keeps its KV cache internal: no pool or per-request accounting "
                   "to inspect",
    "forced_retract": "CTranslate2 cannot take a running request's KV away and resume it later",
    "sessions": "the Generator keeps no KV between generate_batch calls",
    "chunked_prefill": "generate_batch prefills each prompt whole, inside the call",
    "graph_runner": "CTranslate2 exposes no graph runner (static-buffer replay) to probe",
}


def _sampling_key(job: QueuedJob) -> tuple[float, int, float]:
    """generate_batch takes one set of sampling options per call: rows are grouped by it
    (greedy is top-k 1)."""
    p = job.req.params
    if p.greedy:
        return (1.0, 1, 1.0)
    return (float(p.temperature), max(p.top_k, 0), float(p.top_p))  # top-k 0: no limit


def _batch_key(job: QueuedJob) -> tuple[tuple[float, int, float], bool]:
    """The sampling options, and whether the prompt is a single token: in a generate_batch
    call that mixes a one-token prompt with longer ones, CTranslate2 hands the longer rows'
    prompt tokens past the first to the callback as if generated, so such prompts get calls
    of their own (found by the fuzz tier; ``tests/test_ctranslate2_backend.py``)."""
    return _sampling_key(job), len(job.req.prompt_ids) == 1


THREADS_ENV = "SPECGATE_CTRANSLATE2_THREADS"


def intra_threads() -> int:
    """CTranslate2's OpenMP threads: ``$SPECGATE_CTRANSLATE2_THREADS`` if set, else one. In a
    process that also runs torch, one is CTranslate2's best setting: its OpenMP runtime and
    torch's starve each other's threads (docs/measurements.md). Alone in a process it runs
    faster with more (``benchmarks/kernel_floor.py`` measures it that way)."""
    raw = os.environ.get(THREADS_ENV)
    if raw is None:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV}: a positive integer, got {raw!r}")
    return int(raw)


def _without_touching_torch_threads(make: Callable[[], ctranslate2.Generator]
                                    ) -> ctranslate2.Generator:
    """``make()``, then torch's thread count put back as it was. Building a Generator sets the
    calling thread's OpenMP thread count to its ``intra_threads``, which would silently run
    every torch lane beside it at CTranslate2's setting and change the global state compiled
    graphs were built under. Its own generation keeps the count it was built with."""
    threads = torch.get_num_threads()
    try:
        return make()
    finally:
        torch.set_num_threads(threads)


class CT2Handle(QueuedHandle):
    """An opened CTranslate2 generator. ``step`` runs everything queued to completion."""

    def __init__(self, generator: ctranslate2.Generator, vocabulary: list[str],
                 decode: Callable[[list[int]], str], eos: int, max_context_len: int,
                 max_batch: int | None) -> None:
        super().__init__(NAME, len(vocabulary), max_context_len, eos, max_batch, decode,
                         UNCLAIMED_REASONS)
        self.generator: ctranslate2.Generator | None = generator
        self.vocabulary = vocabulary

    def make_job(self, req: Request, rule: FinishRule) -> QueuedJob:
        if not req.params.greedy and req.params.seed is not None:
            raise ValueError("seed: the ctranslate2 backend cannot honour a per-request seed "
                             "(CTranslate2 has one process-wide random seed); leave it unset")
        return QueuedJob(req, rule)

    def run(self, jobs: list[QueuedJob]) -> None:
        for _, same in groupby(sorted(jobs, key=_batch_key), key=_batch_key):
            for batch in self.batches(list(same)):
                self._generate(batch)

    def close(self) -> None:
        super().close()
        self.generator = None

    # --- generation ---------------------------------------------------------------------------

    def _generate(self, jobs: list[QueuedJob]) -> None:
        """One generate_batch call; the callback appends each row's tokens and stops the row
        when its rule finishes it (returning True ends decoding for that batch index)."""
        assert self.generator is not None

        def on_token(step: ctranslate2.GenerationStepResult) -> bool:
            return jobs[step.batch_id].append(step.token_id)

        temperature, top_k, top_p = _sampling_key(jobs[0])  # the same for every row
        self.generator.generate_batch(
            [[self.vocabulary[t] for t in job.req.prompt_ids] for job in jobs],
            max_length=max(job.rule.max_output for job in jobs), end_token=[],
            include_prompt_in_result=False, sampling_temperature=temperature,
            sampling_topk=top_k, sampling_topp=top_p, callback=on_token)
        unfinished = [job.req.rid for job in jobs if job.reason is None]
        if unfinished:  # max_length covers every row's limit, so the callback decides all
            raise RuntimeError(f"{NAME} backend: generate_batch ended before requests "
                               f"{unfinished} finished")


def _ct2_device(name: str) -> tuple[str, int]:
    """``OpenConfig.device`` as CTranslate2's (device, device_index); ValueError (one line)
    where this CTranslate2 build sees no such CUDA device."""
    if name == "cpu":
        return "cpu", 0
    index = int(name.partition(":")[2] or 0)
    count = ctranslate2.get_cuda_device_count()
    if index >= count:
        raise ValueError(f"device: the {NAME} backend cannot run on {name!r}: this CTranslate2 "
                         f"build sees {count} CUDA device(s)")
    return "cuda", index


class CT2Backend:
    name = NAME
    version = ctranslate2.__version__

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none"}))

    def unclaimed_reasons(self) -> dict[str, str]:
        return dict(UNCLAIMED_REASONS)

    def open(self, cfg: OpenConfig) -> CT2Handle:
        if cfg.spec is not None:
            raise ValueError(f"spec: the ctranslate2 backend decodes plainly only: "
                             f"{_NO_SPECULATION}")
        device, index = _ct2_device(cfg.device)
        source: Path = resolve_model_dir(cfg.model)
        config = json.loads((source / "config.json").read_text())
        model_dir = converted_model_dir(source)
        vocabulary = json.loads((model_dir / "vocabulary.json").read_text())
        if len(set(vocabulary)) != len(vocabulary):
            raise ValueError(f"model: {model_dir / 'vocabulary.json'} repeats token strings, so "
                             "prompt ids cannot be passed to CTranslate2 as tokens")
        # Opening reseeds the process-wide generator (there is no per-request one).
        ctranslate2.set_random_seed(cfg.seed)
        # One batch at a time, since step() calls generate_batch synchronously.
        generator = _without_touching_torch_threads(lambda: ctranslate2.Generator(
            str(model_dir), device=device, device_index=index, compute_type=COMPUTE_TYPE,
            intra_threads=intra_threads(), inter_threads=1))
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
        return CT2Handle(generator, vocabulary, tokenizer.decode,
                         eos_token_id(config.get("eos_token_id")),
                         int(config["max_position_embeddings"]), cfg.max_running_requests)


def backend() -> CT2Backend:
    return CT2Backend()
