"""OutputProcessor: resolve a launched step into request state and events.

For every request of a ``StepResult``: append its tokens one at a time with a finish check after
each (a stop inside a speculative run ends it there), commit its KV through the ``KVManager``
(a prefill's or plain decode's positions; a verify step's accepted path; under overlap
scheduling the accepted run minus the pre-claimed root), and on finish free what it holds and
tell the worker. A stale overlap result (its request finished, was aborted or retracted after
the step was launched) changes nothing: no tokens, no acceptance counted, no KV touched. This is
the only code that appends output tokens or finishes a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from refengine.events import Event, FinishEvent, TokenEvent
from refengine.memory.manager import KVManager
from refengine.request import FinishReason, Req, ReqStatus
from refengine.scheduler import Scheduler
from refengine.spec.worker import SpecWorker
from refengine.step import StepResult
from refengine.stopping import finish_reason, stop_string_cut


class OutputProcessor:
    def __init__(self, kv: KVManager, scheduler: Scheduler, worker: SpecWorker | None,
                 live: dict[str, Req], decode: Callable[[list[int]], str], eos_token_id: int,
                 max_context_len: int) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.worker = worker
        self.live = live
        self.decode = decode
        self.eos_token_id = eos_token_id
        self.max_context_len = max_context_len
        self._deferred: list[Req] | None = None

    @contextmanager
    def deferring_release(self) -> Iterator[None]:
        """While a launched step runs on another thread it reads its requests' rows, slots and
        draft state: a request finishing meanwhile has its KV released and its draft state
        dropped only when the bracket ends (after the caller joined that step)."""
        self._deferred = []
        try:
            yield
        finally:
            deferred, self._deferred = self._deferred, None
            for req in deferred:
                self._release(req)

    def _release(self, req: Req) -> None:
        self.scheduler.remove(req)
        if self.worker is not None:
            self.worker.drop(req.rid)

    def resolve(self, result: StepResult, events: list[Event]) -> None:
        if result.verify is None:
            for req, n in zip(result.reqs, result.written, strict=True):
                self.kv.commit(req, n)
            for req, tokens in zip(result.reqs, result.tokens, strict=True):
                if tokens:
                    req.status = ReqStatus.DECODE
                    self.emit(req, tokens, events)
            return
        assert self.worker is not None
        kept: list[int] = []
        for i, req in enumerate(result.reqs):
            if self.is_stale(result, i):
                continue  # finished, aborted or retracted since launch: nothing of it applies
            self.emit(req, result.tokens[i], events, verify_step=True)
            if req.status is ReqStatus.FINISHED:
                continue
            accepted = result.verify.nodes[i]
            if result.overlap:  # KV already in place; the root's slot was pre-claimed
                self.kv.commit(req, len(accepted) - 1)
            else:
                self.kv.commit_path(req, accepted)
            kept.append(i)
        self.worker.resolved(result, kept)

    def is_stale(self, result: StepResult, i: int) -> bool:
        return result.stale(i)

    def finish_reason(self, req: Req) -> FinishReason | None:
        return finish_reason(req.params, req.output_ids, req.seq_len, self.eos_token_id,
                             self.max_context_len, self.decode)

    def emit(self, req: Req, tokens: list[int], events: list[Event],
             verify_step: bool = False) -> int:
        """Append ``tokens`` one at a time, checking finish conditions after each. A verify
        step's kept count is recorded in ``accept_lens`` before any finish, so the last verify
        is counted too. Returns how many tokens were kept."""
        kept: list[int] = []
        reason = None
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            reason = self.finish_reason(req)
            if reason is not None:
                break
        if verify_step:
            req.accept_lens.append(len(kept))
        events.append(TokenEvent(req.rid, tuple(kept)))
        if reason is not None:
            self.finish(req, reason, events)
        return len(kept)

    def finish(self, req: Req, reason: FinishReason, events: list[Event]) -> None:
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
        del self.live[req.rid]
        if self._deferred is not None:
            self._deferred.append(req)
        else:
            self._release(req)
        text = self.decode(req.output_ids)
        if reason == "stop" and req.params.stop:
            cut = stop_string_cut(text, req.params.stop)
            text = text if cut is None else text[:cut]
        events.append(FinishEvent(req.rid, reason, tuple(req.output_ids), text,
                                  tuple(req.accept_lens)))
