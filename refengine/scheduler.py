"""Scheduler: who runs in the next forward, under KV, row and token-budget limits.

Policy (sglang's, simplified):
- prefill first: a chunked prefill in progress continues; otherwise waiting requests are
  admitted in queue order while rows, ``max_running_requests``, the per-step token budget and
  free KV (keeping each decoding request's next-step need as head-room) allow. A prompt
  larger than the budget is prefilled in chunks, one chunked request at a time;
- otherwise every decoding request advances; a decode step needs ``decode_need(req)`` slots
  past each request's allocation (1 plain; under speculation the verify block or the draft
  scratch, or what tops up an overlap reservation). If the pool cannot give each request
  that, the newest requests are retracted (KV and row freed, output kept, re-queued at the
  front) until it can. A retracted session turn keeps the prefix it inherited (and its row).
- test hook ``retract_every = n``: every n-th decode step retracts the middle decoding request
  first (sglang's forced-retract hook; the middle row is the one positional filters get wrong).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from refengine.memory.manager import KVManager
from refengine.request import Req, ReqStatus


@dataclass
class ScheduledBatch:
    mode: Literal["prefill", "decode"]
    reqs: list[Req]
    extend_lens: list[int]
    retracted: list[Req] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, max_running_requests: int, max_prefill_tokens: int,
                 retract_every: int = 0,
                 decode_need: Callable[[Req], int] = lambda req: 1) -> None:
        self.kv = kv
        self.decode_need = decode_need
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.retract_every = retract_every
        self.decode_steps = 0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []   # PREFILL (chunk in progress) and DECODE requests

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """Drop a finished or aborted request from the queues (the output processor releases
        its KV, or keeps it for a session)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        head_room = sum(self.kv.pages_needed(r, self.decode_need(r))
                        for r in self.running if r.status is ReqStatus.DECODE)
        chunked = [r for r in self.running if r.status is ReqStatus.PREFILL]
        candidates = chunked + list(self.waiting)
        for req in candidates:
            remaining = len(req.fill_ids) - req.kv_committed_len
            take = min(remaining, budget)
            fresh = req.status is ReqStatus.WAITING
            if fresh and len(self.running) + len(reqs) >= self.max_running_requests:
                break
            pages = self.kv.pages_needed(req, take)
            if pages + head_room > self.kv.allocator.free_page_count:
                break
            # A session turn may hold its row already (the inherited prefix)
            if fresh and req.row is None and not self.kv.assign_row(req):
                break
            if fresh:
                self.waiting.remove(req)
                self.running.append(req)
                req.status = ReqStatus.PREFILL
            head_room += pages
            reqs.append(req)
            lens.append(take)
            budget -= take
            if take < remaining or budget == 0:
                break  # at most one request is left mid-prompt, and it is the last one
        if not reqs:
            return None
        return ScheduledBatch("prefill", reqs, lens)

    def _schedule_decode(self) -> ScheduledBatch | None:
        retracted: list[Req] = []
        decoding = [r for r in self.running if r.status is ReqStatus.DECODE]
        if decoding:
            self.decode_steps += 1
            if self.retract_every and self.decode_steps % self.retract_every == 0:
                retracted.append(self._retract(decoding[len(decoding) // 2]))
        while True:
            decoding = [r for r in self.running if r.status is ReqStatus.DECODE]
            if not decoding:
                return ScheduledBatch("decode", [], [], retracted) if retracted else None
            if self.kv.can_extend([(r, self.decode_need(r)) for r in decoding]):
                return ScheduledBatch("decode", decoding, [1] * len(decoding), retracted)
            retracted.append(self._retract(max(self.running, key=lambda r: r.arrival)))

    def _retract(self, victim: Req) -> Req:
        self.running.remove(victim)
        self.kv.retract(victim)
        victim.status = ReqStatus.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        return victim
