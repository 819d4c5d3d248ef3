"""HF ``transformers`` as a backend: plain greedy and sampled decoding, run to completion.

It is an independent second implementation of the target model (HF's Llama and KV cache, not
refengine's paged one), which is what makes it useful: greedy output equal to refengine's token
for token is evidence that both forwards are right, and ``specgate bench`` uses it as the speed
yardstick. It claims no stepwise progress, abort, sessions or KV accounting. It runs on
``OpenConfig.device`` (weights and inputs there; sampled draws on the CPU, as refengine's).

With ``OpenConfig.spec.algorithm == "draft_model"`` it runs assisted generation, one request at
a time: the draft model (HF's, with a ``DynamicCache`` of its own) proposes ``num_steps`` greedy
tokens, one target forward over root + drafts verifies them, and both caches are cropped to
what was kept. Greedy keeps the longest agreeing prefix plus the target's next token; sampled
requests use refengine's chain speculative sampling (``verify_tree_sampling``: exactly the
target's distribution, drafts as point masses). ``FinishEvent.accept_lens`` gives the tokens
each verify emitted, so tau is known.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaForCausalLM

from conformance.backends.queued import QueuedHandle, QueuedJob
from conformance.contract import (
    Capabilities,
    OpenConfig,
    Request,
)
from conformance.contract.finish import FinishRule, eos_token_id
from refengine.data import resolve_model_dir
from refengine.sampler import request_seed, sample_one, sampling_probs
from refengine.speculative.verify import verify_tree_sampling

# transformers 5 renamed the forward's cache argument (`past_key_values` -> `cache`) and warns on
# the old name; 4.x knows only the old one.
_CACHE_ARG = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
              else "past_key_values")


@dataclass(frozen=True)
class _Assistant:
    """Assisted generation's draft model and how many tokens it proposes per verify."""

    model: torch.nn.Module
    num_steps: int


_UNSUPPORTED = {"abort": "it runs requests to completion; abort is unsupported",
                "memory_view": "it exposes no KV accounting",
                "sessions": "it has no streaming sessions"}


class HFHandle(QueuedHandle):
    """An opened HF model. ``step`` runs everything queued to completion in one call."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, engine_seed: int,
                 max_batch: int | None, assistant: _Assistant | None = None) -> None:
        cfg = model.config
        super().__init__("hf", int(cfg.vocab_size), int(cfg.max_position_embeddings),
                         eos_token_id(getattr(cfg, "eos_token_id", None),
                                      getattr(tokenizer, "eos_token_id", None)),
                         max_batch, self._decode, _UNSUPPORTED)
        self.model: torch.nn.Module | None = model
        self.assistant = assistant
        self.tokenizer = tokenizer
        self.engine_seed = engine_seed
        self.device = next(model.parameters()).device  # inputs go where the weights are

    def make_job(self, req: Request, rule: FinishRule) -> QueuedJob:
        # refengine's derivation, so unseeded sampled requests also agree across backends.
        p = req.params
        seed = p.seed if p.seed is not None else request_seed(self.engine_seed, req.rid)
        return QueuedJob(req, rule, seed)

    def run(self, jobs: list[QueuedJob]) -> None:
        if self.assistant is not None:
            for job in jobs:
                self._assisted(job, self.assistant)
        else:
            for batch in self.batches(jobs):
                self._generate(batch)

    def close(self) -> None:
        super().close()
        self.model = None

    # --- generation ---------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # Raw decode, as refengine's tokenizers.Tokenizer.decode: special tokens dropped and no
        # "clean-up" of spaces, which would move stop-string matches and text cuts.
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _select(self, logits: torch.Tensor, jobs: list[QueuedJob]) -> list[int]:
        """One token per row: argmax for greedy rows, refengine's seeded draw for sampled ones."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for b, job in enumerate(jobs):
            p = job.req.params
            if not p.greedy:  # refengine's draw, on the CPU like refengine's sampler
                probs = sampling_probs(logits[b].cpu(), p)
                tokens[b] = sample_one(probs, job.seed, len(job.output_ids))
        return tokens

    @torch.inference_mode()
    def _generate(self, jobs: list[QueuedJob]) -> None:
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
        input_ids, mask, positions = (t.to(self.device) for t in (input_ids, mask, positions))
        cache = DynamicCache(config=self.model.config)
        live = list(jobs)
        while live:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, **{_CACHE_ARG: cache})
            tokens = self._select(out.logits[:, -1, :].float(), live)
            keep: list[int] = []
            for b, (job, token) in enumerate(zip(live, tokens, strict=True)):
                if not job.append(token):
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(live):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, positions = mask[index], positions[index]
                live = [live[b] for b in keep]
                tokens = [tokens[b] for b in keep]
            input_ids = torch.tensor(tokens, device=self.device)[:, None]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            positions = positions[:, -1:] + 1


    # --- assisted generation (draft_model) -----------------------------------------------------

    def _forward(self, model: torch.nn.Module, ids: list[int], start: int,
                 cache: DynamicCache) -> torch.Tensor:
        """``ids`` at positions ``start ..`` after what ``cache`` holds -> their float logits."""
        out = model(input_ids=torch.tensor([ids], device=self.device), position_ids=torch.arange(
            start, start + len(ids), device=self.device)[None], use_cache=True,
                    **{_CACHE_ARG: cache})
        return out.logits[0].float()

    @torch.inference_mode()
    def _assisted(self, job: QueuedJob, assistant: _Assistant) -> None:
        """One request: prefill, then draft -> verify -> crop until it finishes. The draft's
        cache lags by what it never ran (the last draft of a fully accepted chain); each step
        first feeds it every token it lacks, then the root."""
        assert self.model is not None
        draft, steps = assistant.model, assistant.num_steps
        target_cache = DynamicCache(config=self.model.config)
        draft_cache = DynamicCache(config=draft.config)
        seq = list(job.req.prompt_ids)
        logits = self._forward(self.model, seq, 0, target_cache)
        if self._emit(job, self._select(logits[-1:], [job])):
            return
        seq.append(job.output_ids[-1])
        while True:
            root = len(seq) - 1                      # the root's position; the caches hold < it
            fed = draft_cache.get_seq_length()
            drafts = [int(self._forward(draft, seq[fed:], fed, draft_cache)[-1].argmax())]
            for i in range(1, steps):
                drafts.append(int(self._forward(draft, drafts[-1:], root + i,
                                                draft_cache)[-1].argmax()))
            chain = [seq[-1], *drafts]
            logits = self._forward(self.model, chain, root, target_cache)
            accepted, bonus = self._verify(job, chain, logits, steps)
            _keep(target_cache, root + 1 + accepted)
            _keep(draft_cache, root + min(accepted + 1, steps))
            run = [*drafts[:accepted], bonus]
            before = len(job.output_ids)
            finished = self._emit(job, run)
            job.accept_lens.append(len(job.output_ids) - before)
            if finished:
                return
            seq.extend(run)

    def _verify(self, job: QueuedJob, chain: list[int], logits: torch.Tensor, steps: int
                ) -> tuple[int, int]:
        """-> (accepted drafts, the token after them) for the chain root + drafts."""
        p = job.req.params
        if p.greedy:
            best = logits.argmax(dim=-1).tolist()
            accepted = 0
            while accepted < steps and chain[accepted + 1] == best[accepted]:
                accepted += 1
            return accepted, best[accepted]
        probs = torch.stack([sampling_probs(row, p) for row in logits.cpu()])
        n = len(chain)
        path = verify_tree_sampling(chain, [*range(1, n), -1], [-1] * n, probs, steps,
                                    job.seed, len(job.output_ids))
        return len(path.nodes) - 1, path.bonus

    def _emit(self, job: QueuedJob, tokens: list[int]) -> bool:
        """Append ``tokens`` one at a time with finish checks; True once the request ends."""
        return any(job.append(token) for token in tokens)


def _keep(cache: DynamicCache, positions: int) -> None:
    """Drop the cache's entries past ``positions`` (``crop`` takes a negative count to drop in
    every transformers version; a positive length is refused by some)."""
    extra = cache.get_seq_length() - positions
    if extra > 0:
        cache.crop(-extra)


class HFBackend:
    name = "hf"
    version = f"transformers {transformers.__version__}"

    def capabilities(self) -> Capabilities:
        # reference_draft: it runs the algorithm on the fixture draft, so its acceptance is
        # held to the golden traces.
        return Capabilities(algorithms=frozenset({"none", "draft_model"}), sampling=True,
                            seeded_sampling=True, acceptance_stats=True, reference_draft=True)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"algorithm:ngram": "transformers' prompt lookup decoding is not wired in: "
                                   "assisted generation runs a draft model only",
                "algorithm:eagle3": "transformers has no EAGLE-3 head (nor a way to hand a "
                                    "draft head the target's intermediate layers): assisted "
                                    "generation runs a standalone draft model only"}

    def open(self, cfg: OpenConfig) -> HFHandle:
        spec = cfg.spec
        if spec is not None and spec.algorithm != "draft_model":
            raise ValueError(f"spec: the hf backend supports plain decoding and draft_model "
                             f"only, got {spec.algorithm!r}")
        device = _torch_device(cfg.device)
        path: Path = resolve_model_dir(cfg.model)
        transformers.utils.logging.disable_progress_bar()  # a loading bar per open is noise
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        assistant = None if spec is None else _Assistant(
            AutoModelForCausalLM.from_pretrained(resolve_model_dir(spec.draft_model),
                                                 dtype=torch.float32).eval().to(device),
            spec.num_steps)
        return HFHandle(model, tokenizer, cfg.seed, cfg.max_running_requests, assistant)


def _torch_device(name: str) -> torch.device:
    """``OpenConfig.device`` as a torch device; ValueError (one line) where torch has no such
    CUDA device."""
    if name != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device: the hf backend cannot run on {name!r}: torch sees no CUDA "
                         "device")
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device: the hf backend cannot run on {name!r}: torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def backend() -> HFBackend:
    return HFBackend()
