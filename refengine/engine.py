"""Engine: the public API (add_request / step / abort / generate / memory) over the scheduler,
the KV manager, the target model and the sampler."""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from refengine.config import EngineConfig, SamplingParams
from refengine.data import resolve_model_dir
from refengine.events import Event, FinishEvent, RetractEvent, TokenEvent
from refengine.memory.manager import KVManager
from refengine.memory.view import MemoryView, ceil_page
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle import EagleDraftModel
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.request import FinishReason, Req, ReqStatus
from refengine.sampler import select_tokens
from refengine.scheduler import ScheduledBatch, Scheduler
from refengine.spec.draft_state import DraftState
from refengine.spec.eagle_v1 import EagleWorker
from refengine.spec.inputs import DraftExtendInput
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
    worker_class: type[EagleWorker] = EagleWorker
    draft_state_class: type[DraftState] = DraftState

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_dir(config.model)
        self.model = LlamaForCausalLM.load(path, _DTYPES[config.dtype], config.device)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_context_len = cfg.max_position_embeddings
        spec = config.spec
        draft = None
        if spec is not None:
            draft = EagleDraftModel.load(resolve_model_dir(spec.draft_model), self.model,
                                         _DTYPES[config.dtype], config.device)
        self.kv = self.kv_manager_class(
            config.kv_pool_tokens, config.page_size, config.max_running_requests,
            self.max_context_len, (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
            _DTYPES[config.dtype], config.device,
            draft_layers=0 if draft is None else len(draft.layers),
            row_headroom=0 if spec is None else max(spec.topk * spec.num_steps,
                                                    spec.num_draft_tokens))
        self.worker = None if spec is None or draft is None else self.worker_class(
            spec, self.model, draft, self.kv)
        self.draft_state = (None if self.worker is None
                            else self.draft_state_class(self.worker.idle_input()))
        self.decode_tokens = 1 if spec is None else max(spec.num_draft_tokens,
                                                        spec.topk * (spec.num_steps - 1))
        self.scheduler = self.scheduler_class(self.kv, config.max_running_requests,
                                              config.max_prefill_tokens, config.retract_every,
                                              self.decode_tokens)
        # Wall seconds per phase (schedule, prefill, decode, draft, verify, extend), for bench.
        self.phase_seconds: dict[str, float] = defaultdict(float)
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
        need = ceil_page(min(len(ids) + params.max_new_tokens, self.max_context_len)
                         + self.decode_tokens, self.kv.page_size)
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
        with self._timed("schedule"):
            batch = self.scheduler.schedule()
        if batch is not None:
            for r in batch.retracted:
                events.append(RetractEvent(r.rid))
                if self.draft_state is not None:
                    self.draft_state.drop(r.rid)
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

    def next_token_logits(self, prompt: Prompt) -> torch.Tensor:
        """The target's float32 logits for the token after ``prompt``."""
        return self._score(prompt, last_only=True)[0]

    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """The target's float32 logits after every position of ``prompt`` ([n, vocab])."""
        return self._score(prompt, last_only=False)

    def _score(self, prompt: Prompt, last_only: bool) -> torch.Tensor:
        """A scoring prefill that leaves the engine as it found it (row and slots released on
        return); logits after the last position only, or after every one."""
        ids = self.tokenize(prompt)
        req = Req("__score__", ids, SamplingParams(max_new_tokens=1), 0, -1)
        if not self.kv.assign_row(req):
            raise RuntimeError("next_token_logits: no free request row")
        try:
            n = len(ids)
            fb = ForwardBatch(torch.tensor(ids), torch.arange(n), self.kv.extend(req, n),
                              self._attention_metadata(torch.tensor([req.row]), [n], [n]),
                              torch.tensor([n - 1]) if last_only else None)
            return self.model(fb, self.kv.kv).logits
        finally:
            self.kv.release(req)

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

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - start

    def _run(self, batch: ScheduledBatch, events: list[Event]) -> None:
        if batch.mode == "decode" and self.worker is not None:
            self._run_spec_decode(batch.reqs, events)
            return
        with self._timed(batch.mode):
            self._run_forward(batch, events)

    def _run_forward(self, batch: ScheduledBatch, events: list[Event]) -> None:
        """A prefill (chunk) or a plain decode step: one target forward, one token sampled for
        every request whose fill is complete."""
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
        tokens = select_tokens(out.logits, [r.params for r in sampled], [r.seed for r in sampled],
                               [len(r.output_ids) for r in sampled])
        if self.worker is not None:  # a prefill: the draft head follows over the same tokens
            self._draft_prefill(reqs, lens, fb, out.features, dict(zip(
                [r.rid for r in sampled], tokens, strict=True)))
        for req, n in zip(reqs, lens, strict=True):
            req.kv_committed_len += n
        for req, token in zip(sampled, tokens, strict=True):
            req.status = ReqStatus.DECODE
            self._emit(req, [token], events)

    def _draft_prefill(self, reqs: list[Req], lens: list[int], fb: ForwardBatch,
                       features: torch.Tensor, sampled: dict[str, int]) -> None:
        """Pair each prefilled position p with the token after it: the next fill token, or the
        sampled token where a request's fill ends (never the sampled token at a chunk
        boundary: bug class "chunked prefill breaks the draft chain")."""
        next_ids: list[int] = []
        last_rows: list[int] = []
        offset = 0
        for req, n in zip(reqs, lens, strict=True):
            start, fill = req.kv_committed_len, req.fill_ids
            following = fill[start + 1:start + n + 1]
            if len(following) < n:
                following = [*following, sampled[req.rid]]
                last_rows.append(offset + n - 1)
            next_ids.extend(following)
            offset += n
        assert self.worker is not None and self.draft_state is not None
        done = [r for r in reqs if r.rid in sampled]
        rows = self.worker.draft_prefill(
            fb, features, torch.tensor(next_ids), torch.tensor(last_rows, dtype=torch.int64),
            torch.tensor([sampled[r.rid] for r in done], dtype=torch.int64))
        self.draft_state.add([r.rid for r in done], rows)

    def _run_spec_decode(self, reqs: list[Req], events: list[Event]) -> None:
        """draft -> verify -> per-token finish checks -> commit -> draft-extend."""
        assert self.worker is not None and self.draft_state is not None
        with self._timed("draft"):
            draft_input = self.draft_state.aligned([r.rid for r in reqs])
            verify_input = self.worker.draft(reqs, draft_input)
        with self._timed("verify"):
            outcome = self.worker.verify(reqs, verify_input)
            unfinished: list[int] = []
            for i, req in enumerate(reqs):
                self._emit(req, outcome.emitted[i], events, verify_step=True)
                if req.status is not ReqStatus.FINISHED:
                    self.worker.commit(req, outcome.nodes[i])
                    unfinished.append(i)
        with self._timed("extend"):
            extend_input = self.worker.extend_input(outcome, unfinished)
            self._install_draft_state([reqs[i] for i in unfinished], extend_input)

    def _install_draft_state(self, reqs: list[Req], extend_input: DraftExtendInput) -> None:
        """Seed 000: when every request finished inside verify there is nothing to extend; an
        idle DraftInput (zero rows, right dtypes) is installed so the next merge works."""
        assert self.worker is not None and self.draft_state is not None
        draft_input = (self.worker.draft_extend(reqs, extend_input) if reqs
                       else self.worker.idle_input())
        self.draft_state.install([r.rid for r in reqs], draft_input)

    def _attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                            seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(self.kv.rows.table, rows, extend_lens, seq_lens)

    def _finish_reason(self, req: Req) -> FinishReason | None:
        return finish_reason(req.params, req.output_ids, req.seq_len, self.eos_token_id,
                             self.max_context_len, self.tokenizer.decode)

    def _emit(self, req: Req, tokens: list[int], events: list[Event],
              verify_step: bool = False) -> int:
        """Append ``tokens`` one at a time, checking finish conditions after each: a stop
        inside a speculative run ends it there. A verify step's kept count is recorded in
        ``accept_lens`` before any finish, so the last verify is counted too. Returns how many
        tokens were kept."""
        kept: list[int] = []
        reason = None
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            reason = self._finish_reason(req)
            if reason is not None:
                break
        if verify_step:
            req.accept_lens.append(len(kept))
        events.append(TokenEvent(req.rid, tuple(kept)))
        if reason is not None:
            self._finish(req, reason, events)
        return len(kept)

    def _finish(self, req: Req, reason: FinishReason, events: list[Event]) -> None:
        req.finish_reason = reason
        self.scheduler.remove(req)
        req.status = ReqStatus.FINISHED
        del self._live[req.rid]
        if self.draft_state is not None:
            self.draft_state.drop(req.rid)
        text = self.tokenizer.decode(req.output_ids)
        if reason == "stop" and req.params.stop:
            cut = stop_string_cut(text, req.params.stop)
            text = text if cut is None else text[:cut]
        events.append(FinishEvent(req.rid, reason, tuple(req.output_ids), text,
                                  tuple(req.accept_lens)))
