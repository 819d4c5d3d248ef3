"""HF ``transformers`` as a backend: plain greedy and sampled decoding, run to completion.

It is an independent second implementation of the target model (HF's Llama and KV cache, not
refengine's paged one), which is what makes it useful: greedy output equal to refengine's token
for token is evidence that both forwards are right, and ``specgate bench`` uses it as the speed
yardstick. It claims no stepwise progress, abort, sessions or KV accounting.

Semantics deliberately mirror refengine so the two can be compared directly:

* finish: a token in ``stop_token_ids``, or EOS unless ``ignore_eos`` -> "stop"; a stop string
  in the decoded output -> "stop" (text cut before the earliest one, the token that completed
  it kept in ``output_ids``); ``max_new_tokens`` or the model's context length -> "length".
* sampling: the distribution is ``refengine.sampler.sampling_probs`` and the draw for output
  position ``i`` is ``sample_one(probs, seed, i)``, with refengine's seed derivation, so a
  seeded run reproduces refengine's sampled output for the same distribution.
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaForCausalLM

from conformance.adapter import (
    Capabilities,
    Event,
    FinishEvent,
    MemoryView,
    OpenConfig,
    Request,
    TokenEvent,
)
from conformance.backends.finish import FinishRule, eos_token_id
from conformance.backends.request_check import check_request
from refengine.data import resolve_model_dir
from refengine.request import FinishReason
from refengine.sampler import sample_one, sampling_probs

# transformers 5 renamed the forward's cache argument (`past_key_values` -> `cache`) and warns on
# the old name; 4.x knows only the old one.
_CACHE_ARG = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
              else "past_key_values")


@dataclass(eq=False)
class _Job:
    """One queued request and its progress inside a ``step``."""

    req: Request
    seed: int
    output_ids: list[int] = field(default_factory=list)
    reason: FinishReason | None = None


class HFHandle:
    """An opened HF model. ``step`` runs everything queued to completion in one call."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, engine_seed: int,
                 max_batch: int) -> None:
        self.model: torch.nn.Module | None = model
        self.tokenizer = tokenizer
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context_len = int(cfg.max_position_embeddings)
        self.eos_token_id = eos_token_id(getattr(cfg, "eos_token_id", None),
                                         getattr(tokenizer, "eos_token_id", None))
        self.engine_seed = engine_seed
        self.max_batch = max_batch
        self._queue: list[_Job] = []

    # --- adapter surface ----------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self._check_open()
        check_request(req, (job.req.rid for job in self._queue), self.vocab_size,
                      self.max_context_len, "hf")
        p = req.params
        # refengine's derivation, so unseeded sampled requests also agree across backends.
        seed = p.seed if p.seed is not None else (
            self.engine_seed * 7919 + zlib.crc32(req.rid.encode())) % (2**31)
        self._queue.append(_Job(req, seed))

    def step(self) -> list[Event]:
        self._check_open()
        jobs, self._queue = self._queue, []
        for start in range(0, len(jobs), self.max_batch):
            self._generate(jobs[start:start + self.max_batch])
        events: list[Event] = []
        for job in jobs:
            assert job.reason is not None
            out = tuple(job.output_ids)
            events.append(TokenEvent(job.req.rid, out))
            events.append(FinishEvent(job.req.rid, job.reason, out, self._final_text(job)))
        return events

    def abort(self, rid: str) -> None:
        raise NotImplementedError("hf backend runs requests to completion; abort is unsupported")

    def memory(self) -> MemoryView:
        raise NotImplementedError("hf backend exposes no KV accounting")

    def open_session(self, session_id: str) -> None:
        raise NotImplementedError("hf backend has no streaming sessions")

    def close_session(self, session_id: str) -> None:
        raise NotImplementedError("hf backend has no streaming sessions")

    def close(self) -> None:
        self.model = None
        self._queue = []

    # --- generation ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.model is None:
            raise RuntimeError("hf backend: handle is closed")

    def _decode(self, ids: list[int]) -> str:
        # Raw decode, as refengine's tokenizers.Tokenizer.decode: special tokens dropped and no
        # "clean-up" of spaces, which would move stop-string matches and text cuts.
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _rule(self, job: _Job) -> FinishRule:
        return FinishRule(job.req.params, len(job.req.prompt_ids), self.eos_token_id,
                          self.max_context_len, self._decode)

    def _final_text(self, job: _Job) -> str:
        return self._rule(job).text(job.output_ids, job.reason)

    def _select(self, logits: torch.Tensor, jobs: list[_Job]) -> list[int]:
        """One token per row: argmax for greedy rows, refengine's seeded draw for sampled ones."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for b, job in enumerate(jobs):
            p = job.req.params
            if not p.greedy:
                probs = sampling_probs(logits[b], p)
                tokens[b] = sample_one(probs, job.seed, len(job.output_ids))
        return tokens

    @torch.inference_mode()
    def _generate(self, jobs: list[_Job]) -> None:
        """Decode ``jobs`` together: left-padded prefill, then one token per live row per forward.

        Position ids are given explicitly (count of real tokens before each one) so a padded row
        sees exactly the positions it would alone; finished rows are dropped from the batch and
        the cache, so a long request does not drag finished ones along.
        """
        assert self.model is not None
        width = max(len(j.req.prompt_ids) for j in jobs)
        input_ids = torch.zeros(len(jobs), width, dtype=torch.long)
        mask = torch.zeros(len(jobs), width, dtype=torch.long)
        for b, job in enumerate(jobs):
            n = len(job.req.prompt_ids)
            input_ids[b, width - n:] = torch.tensor(job.req.prompt_ids)
            mask[b, width - n:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        live = list(jobs)
        while live:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, **{_CACHE_ARG: cache})
            tokens = self._select(out.logits[:, -1, :].float(), live)
            keep: list[int] = []
            for b, (job, token) in enumerate(zip(live, tokens, strict=True)):
                job.output_ids.append(token)
                job.reason = self._rule(job).reason(job.output_ids)
                if job.reason is None:
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(live):
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                mask, positions = mask[index], positions[index]
                live = [live[b] for b in keep]
                tokens = [tokens[b] for b in keep]
            input_ids = torch.tensor(tokens)[:, None]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            positions = positions[:, -1:] + 1


class HFBackend:
    name = "hf"
    version = f"transformers {transformers.__version__}"

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none"}), sampling=True, seeded_sampling=True)

    def open(self, cfg: OpenConfig) -> HFHandle:
        if cfg.spec is not None:
            raise ValueError("spec: the hf backend supports plain decoding only")
        path: Path = resolve_model_dir(cfg.model)
        transformers.utils.logging.disable_progress_bar()  # a loading bar per open is noise
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        return HFHandle(model, tokenizer, cfg.seed, cfg.max_running_requests)


def backend() -> HFBackend:
    return HFBackend()
