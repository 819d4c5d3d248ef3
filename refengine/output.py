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

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from refengine.events import Event, FinishEvent, TokenEvent
from refengine.memory.manager import KVManager
from refengine.memory.sessions import SessionStore
from refengine.request import FinishReason, Req, ReqStatus
from refengine.scheduler import Scheduler
from refengine.speculative.worker import SpecWorker
from refengine.step import StepResult
from refengine.stopping import finish_reason, stop_string_cut


class OutputProcessor:
    def __init__(self, kv: KVManager, scheduler: Scheduler, worker: SpecWorker | None,
                 sessions: SessionStore, live: dict[str, Req],
                 decode: Callable[[list[int]], str], eos_token_id: int,
                 max_context_len: int) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.worker = worker
        self.sessions = sessions
        self.live = live
        self.decode = decode
        self.eos_token_id = eos_token_id
        self.max_context_len = max_context_len
        self._deferred: list[Req] | None = None
        # Overlap scheduling: the requests whose root slot the newest launched, unresolved
        # step pre-claimed. One that finishes before that step is resolved gives the claim
        # back at its finish, so its committed KV is exactly its tokens' (what a session
        # keeps); the step's result for it is then stale and changes nothing.
        self._claimed: set[Req] = set()

    def hold_claims(self, reqs: Iterable[Req]) -> None:
        """At schedule: the requests whose root slot the step just scheduled pre-claimed
        (none outside overlap scheduling) become the claims a finish gives back, replacing
        the previous step's."""
        self._claimed = set(reqs)

    @contextmanager
    def deferring_release(self) -> Iterator[None]:
        """While a launched step runs on another thread it reads its requests' rows, slots and
        draft state: a release due meanwhile happens only when the bracket ends (after the
        caller joined that step)."""
        self._deferred = []
        try:
            yield
        finally:
            deferred, self._deferred = self._deferred, None
            for req in deferred:
                self._release(req)

    def _release(self, req: Req) -> None:
        if self._deferred is not None:
            self._deferred.append(req)
            return
        if req.session_id is not None:
            self.sessions.end_turn(req)
        else:
            self.kv.release(req)
        if self.worker is not None:
            self.worker.drop(req.rid)

    def resolve(self, result: StepResult, events: list[Event]) -> None:
        # The accepted paths' KV moves as one copy (``KVManager.batched_moves``), done before
        # the worker's draft-extend, which may read the target's KV (Frozen-KV MTP).
        with self.kv.batched_moves():
            kept = self._resolve_requests(result, events)
        if result.verify is not None:
            assert self.worker is not None
            self.worker.resolved(result, kept)

    def _resolve_requests(self, result: StepResult, events: list[Event]) -> list[int]:
        """Each request's part of ``result`` applied in order; -> the indices of those still
        running after a verify step."""
        kept: list[int] = []
        for i, req in enumerate(result.reqs):
            if self.is_stale(result, i):
                continue  # finished, aborted or retracted since launch: nothing of it applies
            tokens = result.tokens[i]
            before = len(req.output_ids)
            reason = self.append(req, tokens)
            if result.verify is None:
                self.kv.commit(req, result.written[i])
                if tokens:
                    req.status = ReqStatus.DECODE
            else:
                # A stop inside the accepted run ends it there: only the kept part is
                # committed, so a session keeps exactly the KV of its tokens.
                run = len(req.output_ids) - before
                req.accept_lens.append(run)
                self.commit_run(req, result.verify.nodes[i][:run], result.overlap)
            if tokens or result.verify is not None:
                events.append(TokenEvent(req.rid, tuple(req.output_ids[before:])))
            if reason is not None:
                self.finish(req, reason, events)
            elif result.verify is not None:
                kept.append(i)
        return kept

    def commit_run(self, req: Req, nodes: list[int], overlap: bool) -> None:
        """Commit a verify step's accepted nodes (root first). Under overlap scheduling their
        KV is already in place and the root's slot was pre-claimed at schedule time."""
        if overlap:
            self.kv.commit(req, len(nodes) - 1)
        else:
            self.kv.commit_path(req, nodes)

    def is_stale(self, result: StepResult, i: int) -> bool:
        return result.stale(i)

    def finish_reason(self, req: Req) -> FinishReason | None:
        return finish_reason(req.params, req.output_ids, req.seq_len, self.eos_token_id,
                             self.max_context_len, self.decode)

    def append(self, req: Req, tokens: list[int]) -> FinishReason | None:
        """Append ``tokens`` one at a time, checking finish conditions after each; the first
        that holds ends the run there and is returned."""
        for token in tokens:
            req.output_ids.append(token)
            reason = self.finish_reason(req)
            if reason is not None:
                return reason
        return None

    def finish(self, req: Req, reason: FinishReason, events: list[Event]) -> None:
        req.finish_reason = reason
        req.status = ReqStatus.FINISHED
        del self.live[req.rid]
        self.scheduler.remove(req)
        if req in self._claimed:
            self._claimed.discard(req)
            self.kv.unclaim(req)
        self._release(req)
        text = self.decode(req.output_ids)
        if reason == "stop" and req.params.stop:
            cut = stop_string_cut(text, req.params.stop)
            text = text if cut is None else text[:cut]
        events.append(FinishEvent(req.rid, reason, tuple(req.output_ids), text,
                                  tuple(req.accept_lens), req.cached_prefix))
