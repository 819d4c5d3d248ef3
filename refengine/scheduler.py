"""Scheduler: who runs in the next forward, under KV, row and token-budget limits.

Policy (sglang's, simplified):
- prefill first: a chunked prefill in progress continues; otherwise waiting requests are
  admitted in queue order while rows, ``max_running_requests``, the per-step token budget and
  free KV (keeping the pages each decoding request's next reservation needs) allow. A prompt
  larger than the budget is prefilled in chunks, one chunked request at a time;
- otherwise every decoding request advances; a decode step holds a ``DecodeReservation``
  past each request's committed end (1 slot plain; under speculation the verify block or the
  draft scratch, or an overlap reservation). If the pool cannot top every request up to it,
  the newest requests are retracted (KV and row freed, output kept, re-queued at the front)
  until it can. A retracted session turn keeps the prefix it inherited (and its row).

Scheduling decides *and allocates*: a prefill chunk's slots and every decode reservation are
taken here, so launch only reads the KV bookkeeping and writes KV into the slots it was given.
- test hook ``retract_every = n``: every n-th decode step retracts the middle decoding request
  first (sglang's forced-retract hook; the middle row is the one positional filters get wrong).
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal

import torch

from refengine.memory.manager import KVManager
from refengine.memory.reservation import PLAIN_DECODE, DecodeReservation
from refengine.request import Req, ReqStatus


@dataclass
class ScheduledBatch:
    mode: Literal["prefill", "decode"]
    reqs: list[Req]
    extend_lens: list[int]
    retracted: list[Req] = field(default_factory=list)
    # Overlap scheduling: the requests whose root slot this decode step pre-claimed.
    claimed: list[Req] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVManager, max_running_requests: int, max_prefill_tokens: int,
                 retract_every: int = 0,
                 reservation: DecodeReservation = PLAIN_DECODE) -> None:
        self.kv = kv
        self.reservation = reservation
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

    def scoring(self, req: Req, tokens: int) -> AbstractContextManager[torch.Tensor]:
        """A scoring forward outside the step loop (``Engine.next_token_logits``): a row and
        ``tokens`` slots for ``req`` while the bracket lasts, yielded as the slots."""
        return self.kv.scoring(req, tokens)

    def top_up(self, req: Req) -> int:
        """Positions ``req``'s allocation must grow by to hold its next decode reservation: the
        room prefill leaves free and the decode step finds (or retracts for)."""
        return self.kv.top_up(req, self.reservation)

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        # Pages the decoding requests' next reservations need: prefill leaves them free.
        top_up_pages = sum(self.kv.pages_needed(r, self.top_up(r))
                           for r in self.running if r.status is ReqStatus.DECODE)
        chunked = [r for r in self.running if r.status is ReqStatus.PREFILL]
        candidates = chunked + list(self.waiting)
        # One row-table write for every chunk admitted (``KVManager.batched_writes``).
        with self.kv.batched_writes():
            for req in candidates:
                remaining = len(req.fill_ids) - req.kv_committed_len
                take = min(remaining, budget)
                fresh = req.status is ReqStatus.WAITING
                if fresh and len(self.running) + len(reqs) >= self.max_running_requests:
                    break
                pages = self.kv.pages_needed(req, take)
                if pages + top_up_pages > self.kv.allocator.free_page_count:
                    break
                # A session turn may hold its row already (the inherited prefix)
                if fresh and req.row is None and not self.kv.assign_row(req):
                    break
                if fresh:
                    self.waiting.remove(req)
                    self.running.append(req)
                    req.status = ReqStatus.PREFILL
                self.kv.grow(req, take)  # the chunk's slots (the free count drops by ``pages``)
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
            if self.kv.can_extend([(r, self.top_up(r)) for r in decoding]):
                with self.kv.batched_writes():
                    for r in decoding:
                        self.kv.reserve(r, self.reservation)
                claimed = decoding if self.reservation.preclaim_root else []
                return ScheduledBatch("decode", decoding, [1] * len(decoding), retracted,
                                      list(claimed))
            retracted.append(self._retract(max(self.running, key=lambda r: r.arrival)))

    def _retract(self, victim: Req) -> Req:
        self.running.remove(victim)
        self.kv.retract(victim)
        victim.status = ReqStatus.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        return victim
