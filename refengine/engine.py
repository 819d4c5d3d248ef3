"""Engine: the public API (add_request / step / abort / generate / memory) over the scheduler,
the KV manager, the target model and the sampler."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from refengine.config import EngineConfig, SamplingParams
from refengine.data import resolve_model_dir
from refengine.events import Event, FinishEvent, RetractEvent, TokenEvent
from refengine.memory.manager import KVManager
from refengine.memory.view import MemoryView, ceil_page
from refengine.model.attention import AttentionMetadata
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.request import FinishReason, Req, ReqStatus
from refengine.sampler import select_tokens
from refengine.scheduler import ScheduledBatch, Scheduler
from refengine.stopping import finish_reason, stop_string_cut

Prompt = str | Sequence[int]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RequestOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    accept_lens: list[int] = field(default_factory=list)  # per verify step; [] for plain


class Engine:
    # Component classes: the extension points a variant engine (e.g. the bug zoo) overrides.
    kv_manager_class: type[KVManager] = KVManager
    scheduler_class: type[Scheduler] = Scheduler

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_dir(config.model)
        self.model = LlamaForCausalLM.load(path, _DTYPES[config.dtype], config.device)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_context_len = cfg.max_position_embeddings
        self.kv = self.kv_manager_class(
            config.kv_pool_tokens, config.page_size, config.max_running_requests,
            self.max_context_len, (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
            _DTYPES[config.dtype], config.device)
        self.scheduler = self.scheduler_class(self.kv, config.max_running_requests,
                                   config.max_prefill_tokens)
        self._live: dict[str, Req] = {}
        self._pending: list[Event] = []
        self._arrivals = 0
        self._anonymous = 0

    # --- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt: token id {t!r} is outside the vocabulary "
                                     f"(0..{self.vocab_size - 1})")
        if not ids:
            raise ValueError("prompt: empty (at least one token is needed)")
        return ids

    def add_request(self, rid: str, prompt: Prompt, params: SamplingParams | None = None,
                    session_id: str | None = None) -> None:
        params = params or SamplingParams()
        if session_id is not None:
            raise ValueError("session_id: streaming sessions are not implemented yet")
        if rid in self._live:
            raise ValueError(f"rid: request {rid!r} is already live")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_context_len:
            raise ValueError(f"prompt: {len(ids)} tokens exceed the context length "
                             f"{self.max_context_len} (room for at least one new token needed)")
        need = ceil_page(min(len(ids) + params.max_new_tokens, self.max_context_len),
                         self.kv.page_size)
        if need > self.kv.capacity:
            raise ValueError(f"kv_pool_tokens: request {rid!r} needs up to {need} KV slots "
                             f"(prompt {len(ids)} + max_new_tokens {params.max_new_tokens}) but "
                             f"the pool holds {self.kv.capacity}")
        seed = params.seed if params.seed is not None else (
            self.config.seed * 7919 + zlib.crc32(rid.encode())) % (2**31)
        req = Req(rid, ids, params, seed, self._arrivals)
        self._arrivals += 1
        self._live[rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` in any phase; its FinishEvent(reason="abort") comes with the next step."""
        req = self._live.get(rid)
        if req is None:
            return  # unknown or already finished: aborting is idempotent
        self._finish(req, "abort", self._pending)

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> list[Event]:
        events, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch is not None:
            events.extend(RetractEvent(r.rid) for r in batch.retracted)
            if batch.reqs:
                self._run(batch, events)
        if self.config.strict_mem_check:
            self.kv.strict_check(list(self._live.values()), self.reserve_bound)
        return events

    def has_work(self) -> bool:
        return bool(self._live) or bool(self._pending)

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or token ids
        plist = (list(params) if isinstance(params, Sequence) else [params] * len(prompts))
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
        rids = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"gen-{self._anonymous}"
            self._anonymous += 1
            self.add_request(rid, prompt, p)
            rids.append(rid)
        prompt_ids = {rid: self._live[rid].prompt_ids for rid in rids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            for ev in self.step():
                if isinstance(ev, FinishEvent) and ev.rid in prompt_ids:
                    done[ev.rid] = RequestOutput(ev.rid, prompt_ids[ev.rid], list(ev.output_ids),
                                                 ev.text, ev.reason, list(ev.accept_lens))
        return [done[r] for r in rids]

    def memory(self) -> MemoryView:
        return self.kv.view(list(self._live.values()), self.reserve_bound)

    @property
    def reserve_bound(self) -> int:
        """Plain decoding reserves nothing ahead: allocated == committed between steps."""
        return 0

    def open_session(self, session_id: str) -> None:
        raise NotImplementedError("streaming sessions are not implemented yet")

    def close_session(self, session_id: str) -> None:
        raise NotImplementedError("streaming sessions are not implemented yet")

    # --- internals ----------------------------------------------------------------------------

    def _run(self, batch: ScheduledBatch, events: list[Event]) -> None:
        reqs, lens = batch.reqs, batch.extend_lens
        ids, positions, slots, sample_at, sampled = [], [], [], [], []
        offset = 0
        for req, n in zip(reqs, lens, strict=True):
            start = req.kv_committed_len
            source = req.fill_ids if batch.mode == "prefill" else req.output_ids[-1:]
            ids.extend(source[start:start + n] if batch.mode == "prefill" else source)
            positions.append(torch.arange(start, start + n))
            slots.append(self.kv.extend(req, n))
            offset += n
            if batch.mode == "decode" or start + n == len(req.fill_ids):
                sample_at.append(offset - 1)
                sampled.append(req)
        rows = torch.tensor([r.row for r in reqs])
        seq_lens = [r.kv_committed_len + n for r, n in zip(reqs, lens, strict=True)]
        fb = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.cat(positions),
            out_slots=torch.cat(slots),
            attention=self._attention_metadata(rows, lens, seq_lens),
            logits_index=torch.tensor(sample_at, dtype=torch.int64))
        out = self.model(fb, self.kv.kv)
        for req, n in zip(reqs, lens, strict=True):
            req.kv_committed_len += n
        tokens = select_tokens(out.logits, [r.params for r in sampled], [r.seed for r in sampled],
                               [len(r.output_ids) for r in sampled])
        for req, token in zip(sampled, tokens, strict=True):
            req.status = ReqStatus.DECODE
            self._emit(req, token, events)

    def _attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                            seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(self.kv.rows.table, rows, extend_lens, seq_lens)

    def _finish_reason(self, req: Req) -> FinishReason | None:
        return finish_reason(req.params, req.output_ids, req.seq_len, self.eos_token_id,
                             self.max_context_len, self.tokenizer.decode)

    def _emit(self, req: Req, token: int, events: list[Event]) -> None:
        req.output_ids.append(token)
        events.append(TokenEvent(req.rid, (token,)))
        reason = self._finish_reason(req)
        if reason is not None:
            self._finish(req, reason, events)

    def _finish(self, req: Req, reason: FinishReason, events: list[Event]) -> None:
        req.finish_reason = reason
        self.scheduler.remove(req)
        req.status = ReqStatus.FINISHED
        del self._live[req.rid]
        text = self.tokenizer.decode(req.output_ids)
        if reason == "stop" and req.params.stop:
            cut = stop_string_cut(text, req.params.stop)
            text = text if cut is None else text[:cut]
        events.append(FinishEvent(req.rid, reason, tuple(req.output_ids), text))
