"""Engine: the public API (add_request / step / abort / generate / memory) over five parts:
the ``Scheduler`` (who runs, and the KV they get), the ``KVManager`` (KV bookkeeping), the
``ModelRunner`` (every forward), an optional speculative worker (``SpeculativeWorker``: the
verify core and an algorithm's drafter) and the ``OutputProcessor`` (tokens, finish, commit).

A step is schedule -> launch -> resolve. Schedule picks the batch and allocates every KV slot
the step writes; launch runs the forwards, reading request and KV bookkeeping and writing KV
tensors into the slots it was given; resolve appends tokens, finishes requests and commits
(and frees) KV (``tests/test_kv_writer_rule.py``). Under overlap scheduling launch also runs
draft-extend, so it moves accepted KV between slots a request holds and updates the worker's
own draft state and roots (never request state): the next step is launched from them before
this one is resolved. Variants (the bug zoo) replace a component class, never a method of the
engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer

from refengine.clock import PhaseClock
from refengine.config import EngineConfig, SamplingParams, SpecConfig
from refengine.data import resolve_model_dir
from refengine.events import Event, FinishEvent, RetractEvent
from refengine.graph.runner import GraphRunner
from refengine.memory.manager import KVManager
from refengine.memory.reservation import PLAIN_DECODE
from refengine.memory.sessions import SessionStore
from refengine.memory.view import MemoryView, ceil_page
from refengine.model.eagle import EagleDraftModel
from refengine.model.eagle3 import Eagle3DraftModel, EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import LlamaForCausalLM
from refengine.model.standalone_draft import StandaloneDraftModel
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req
from refengine.runner import ModelRunner, Runner
from refengine.sampler import request_seed, select_tokens
from refengine.scheduler import ScheduledBatch, Scheduler
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.draft_model import DraftModelDrafter
from refengine.speculative.drafter import Drafter
from refengine.speculative.eagle import EagleDrafter
from refengine.speculative.frozen_kv_mtp import FrozenKVMTPDrafter
from refengine.speculative.modes import row_headroom
from refengine.speculative.ngram import NgramDrafter
from refengine.speculative.worker import SpecWorker
from refengine.step import StepResult

Prompt = str | Sequence[int]
DraftClass = (type[EagleDraftModel] | type[Eagle3DraftModel] | type[FrozenKVMTPDraftModel]
              | type[StandaloneDraftModel])
DrafterClass = Callable[[SpecConfig, Runner], Drafter[Any]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_kv_layers(draft: torch.nn.Module | None) -> int:
    """Layers of the draft pool beside the target's KV: EAGLE's head and a standalone draft
    model keep KV of their own; a frozen-KV draft only reads the target's."""
    if isinstance(draft, EagleHead):
        return len(draft.layers)
    if isinstance(draft, StandaloneDraftModel):
        return draft.kv_layers
    return 0


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
    runner_class: type[ModelRunner] = ModelRunner
    graph_runner_class: type[GraphRunner] = GraphRunner  # wraps the runner (cuda_graph=True)
    # The verify core every speculative algorithm runs on (sequential or overlap), the
    # drafter of each algorithm it composes with, and the draft model of those that have one.
    worker_class: type[SpeculativeWorker] = SpeculativeWorker
    drafter_classes: ClassVar[dict[str, DrafterClass]] = {
        "eagle": EagleDrafter, "eagle3": EagleDrafter, "frozen_kv_mtp": FrozenKVMTPDrafter,
        "draft_model": DraftModelDrafter, "ngram": NgramDrafter}
    draft_classes: ClassVar[dict[str, DraftClass]] = {
        "eagle": EagleDraftModel, "eagle3": Eagle3DraftModel,
        "frozen_kv_mtp": FrozenKVMTPDraftModel,
        "draft_model": StandaloneDraftModel}
    output_class: type[OutputProcessor] = OutputProcessor

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
        if spec is not None and spec.needs_draft_model:
            draft = self.draft_classes[spec.algorithm].load(
                resolve_model_dir(spec.draft_model), self.model, _DTYPES[config.dtype],
                config.device)
        if isinstance(draft, Eagle3DraftModel):  # the target's forward fuses the head's taps
            self.model.use_feature_tap(draft.tap)
        self.kv = self.kv_manager_class(
            config.kv_pool_tokens, config.page_size, config.max_running_requests,
            self.max_context_len, (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
            _DTYPES[config.dtype], config.device,
            draft_layers=draft_kv_layers(draft),
            row_headroom=0 if spec is None else row_headroom(spec, config.page_size))
        self.clock = PhaseClock()
        self.runner: ModelRunner | GraphRunner = self.runner_class(self.model, draft, self.kv)
        if config.cuda_graph:
            self.runner = self.graph_runner_class(self.runner, config.graph_executor,
                                      max_bs=config.max_running_requests,
                                      verify_tokens=None if spec is None
                                      else spec.num_draft_tokens,
                                      draft_steps=None if spec is None
                                      else (spec.topk, spec.num_steps))
        self.worker: SpecWorker | None = None
        if spec is not None:
            self.worker = self.worker_class(
                spec, self.runner, self.kv, self.clock,
                self.drafter_classes[spec.algorithm](spec, self.runner))
        self.reservation = PLAIN_DECODE if self.worker is None else self.worker.reservation
        self.scheduler = self.scheduler_class(
            self.kv, config.max_running_requests, config.max_prefill_tokens,
            config.retract_every, self.reservation)
        self._live: dict[str, Req] = {}
        self.sessions = SessionStore(self.kv)
        self.output = self.output_class(self.kv, self.scheduler, self.worker, self.sessions,
                                        self._live,
                                        self.tokenizer.decode, self.eos_token_id,
                                        self.max_context_len)
        self._pending: list[Event] = []
        self._in_flight: StepResult | None = None  # overlap: launched, resolved next step
        # Overlap with a thread: a decode step's forwards run here while the previous step is
        # resolved. One worker, so launches keep their order (what a GPU stream guarantees).
        self._launcher: ThreadPoolExecutor | None = None
        if spec is not None and spec.overlap and config.overlap_thread:
            self._launcher = ThreadPoolExecutor(1, thread_name_prefix="refengine-launch")
            weakref.finalize(self, self._launcher.shutdown, wait=False)
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
        """Queue a request. With ``session_id`` it is the session's next turn: ``prompt``
        holds only the new tokens, the session's context goes before them, and its KV is
        reused rather than prefilled again."""
        params = params or SamplingParams()
        if rid in self._live:
            raise ValueError(f"rid: request {rid!r} is already live")
        ids = self.tokenize(prompt)
        if session_id is not None:
            ids = self.sessions.context(session_id) + ids
        if len(ids) >= self.max_context_len:
            raise ValueError(f"prompt: {len(ids)} tokens exceed the context length "
                             f"{self.max_context_len} (room for at least one new token needed)")
        need = ceil_page(min(len(ids) + params.max_new_tokens, self.max_context_len)
                         + self.reservation.reach, self.kv.page_size)
        if need > self.kv.capacity:
            raise ValueError(f"kv_pool_tokens: request {rid!r} needs up to {need} KV slots "
                             f"(prompt {len(ids)} + max_new_tokens {params.max_new_tokens}) but "
                             f"the pool holds {self.kv.capacity}")
        seed = params.seed if params.seed is not None else request_seed(self.config.seed, rid)
        req = Req(rid, ids, params, seed, self._arrivals, session_id=session_id)
        if session_id is not None:
            self.sessions.begin_turn(session_id, req)
        self._arrivals += 1
        self._live[rid] = req
        self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` in any phase; its FinishEvent(reason="abort") comes with the next step."""
        req = self._live.get(rid)
        if req is None:
            return  # unknown or already finished: aborting is idempotent
        self.output.finish(req, "abort", self._pending)

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """schedule -> launch -> resolve, then the strict memory check. Under overlap
        scheduling a decode step is resolved one engine step later, after the next step was
        scheduled and launched (on the launch thread, running while the previous step is
        resolved); everything else is resolved at once, oldest first. Every launch is joined
        before ``step`` returns, so callers never race a running forward."""
        events, self._pending = self._pending, []
        batch = self._schedule(events)
        launched = self._launch_beside_previous(batch, events)
        self._resolve_or_hold(launched, events)
        if self.config.strict_mem_check:
            self.kv.strict_check(self.memory())
        return events

    def _schedule(self, events: list[Event]) -> ScheduledBatch | None:
        """Pick the batch (its pre-claimed roots held until it is resolved) and report the
        requests retracted to make room for it."""
        with self.clock.timed("schedule"):
            batch = self.scheduler.schedule()
            self.output.hold_claims([] if batch is None else batch.claimed)
        for r in [] if batch is None else batch.retracted:
            events.append(RetractEvent(r.rid))
            if self.worker is not None:
                self.worker.drop(r.rid)
        return batch

    def _launch_beside_previous(self, batch: ScheduledBatch | None, events: list[Event]
                                ) -> StepResult | None:
        """Launch ``batch`` and resolve the step still in flight: while the launch runs on
        the launch thread, else after it. The requests the running launch reads keep their
        rows and draft state until it is joined."""
        if batch is None or not batch.reqs:
            self._resolve_in_flight(events)
            return None
        launcher = self._launcher
        if launcher is None or batch.mode != "decode":
            launched = self.launch(batch)
            self._resolve_in_flight(events)
            return launched
        running = self._launch_on_thread(launcher, batch)
        with self.output.deferring_release():
            self._resolve_in_flight(events)
            return running.result()

    def _launch_on_thread(self, launcher: ThreadPoolExecutor, batch: ScheduledBatch
                          ) -> Future[StepResult]:
        """Graphs the launch thread needed first are captured here, on this thread, while
        nothing else runs (a capture beside the resolve that follows would race it)."""
        self.runner.capture_pending()
        return launcher.submit(self.launch, batch)

    def _resolve_in_flight(self, events: list[Event]) -> None:
        """Resolve the overlap step launched by the previous engine step, if one is waiting."""
        if self._in_flight is not None:
            self.output.resolve(self._in_flight, events)
            self._in_flight = None

    def _resolve_or_hold(self, launched: StepResult | None, events: list[Event]) -> None:
        """An overlap step stays in flight until the next engine step; any other is resolved
        now."""
        if launched is not None and launched.overlap:
            self._in_flight = launched
        elif launched is not None:
            self.output.resolve(launched, events)

    def launch(self, batch: ScheduledBatch) -> StepResult:
        """Run the batch's forwards into the slots schedule allocated; request state changes
        only in resolve."""
        if batch.mode == "decode" and self.worker is not None:
            return self.worker.launch(batch.reqs)
        with self.clock.timed(batch.mode):
            return self._launch_extend(batch)

    def _launch_extend(self, batch: ScheduledBatch) -> StepResult:
        """A prefill (chunk) or a plain decode step: one target forward, one token sampled for
        every request whose fill is complete."""
        reqs, lens = batch.reqs, batch.extend_lens
        ids: list[int] = []
        sample_at: list[int] = []
        sampled: list[Req] = []
        for req, n in zip(reqs, lens, strict=True):
            start = req.kv_committed_len
            ids.extend(req.fill_ids[start:start + n] if batch.mode == "prefill"
                       else req.output_ids[-1:])
            if batch.mode == "decode" or start + n == len(req.fill_ids):
                sample_at.append(len(ids) - 1)
                sampled.append(req)
        forward_batch = self.runner.prepare_extend(reqs, lens, ids, sample_at)
        out = self.runner.forward(forward_batch)
        tokens = select_tokens(out.logits, [r.params for r in sampled], [r.seed for r in sampled],
                               [len(r.output_ids) for r in sampled])
        by_rid = dict(zip([r.rid for r in sampled], tokens, strict=True))
        if self.worker is not None:  # a prefill: the draft follows over the same tokens
            self.worker.prefill(reqs, lens, forward_batch, out.features, by_rid)
        return StepResult(reqs, [[by_rid[r.rid]] if r.rid in by_rid else [] for r in reqs],
                          list(lens))

    def in_flight(self) -> frozenset[str]:
        """Requests of the launched step not resolved yet (overlap scheduling), finished ones
        included: its result for a request that finished, is aborted now or retracted at the
        next schedule is stale and changes nothing."""
        return frozenset() if self._in_flight is None else frozenset(
            r.rid for r in self._in_flight.reqs)

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
        with self.scheduler.scoring(req, len(ids)) as slots:
            return self.runner.forward(
                self.runner.prepare_score(req, ids, slots, last_only)).logits

    def memory(self) -> MemoryView:
        held, rows_held = self.sessions.held()
        return self.kv.view(list(self._live.values()), self.reserve_bound, held, rows_held)

    @property
    def reserve_bound(self) -> int:
        """How far past its committed end a request may hold KV between steps: nothing for
        plain decoding (allocated == committed), else what the worker states."""
        return 0 if self.worker is None else self.worker.reserve_bound

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Wall seconds per phase (schedule, prefill, decode, draft, verify, extend)."""
        return self.clock.seconds

    def open_session(self, session_id: str) -> None:
        """Open a streaming session: requests naming it are its turns, one live at a time,
        each continuing the KV of the turns before it (``refengine/memory/sessions.py``)."""
        self.sessions.open(session_id)

    def close_session(self, session_id: str) -> None:
        """Free everything the session holds; its turn must have finished or been aborted."""
        self.sessions.close(session_id)
