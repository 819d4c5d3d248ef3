"""Test-only backends that model legitimate variants of the adapter contract: the reference
engine with one behaviour changed the way a conforming engine may differ, for certifying that
the suite fails none of them.

* ``queueing_backend()`` (``--backend tests.variant_backends:queueing_backend``): handles memory
  pressure by queueing instead of retracting. It admits a waiting request only when the KV pool
  can hold its whole run (prompt plus ``max_new_tokens`` and a decode step's reservation) beside
  what the running requests may still grow to, so it never retracts; it does not claim
  ``forced_retract``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from conformance.backends.refengine import RefEngineBackend
from conformance.contract import Capabilities
from refengine import Engine
from refengine.request import Req
from refengine.scheduler import ScheduledBatch, Scheduler


class QueueingScheduler(Scheduler):
    """Admission by whole need, in queue order; a request alone in the engine is always
    admitted (the engine refused any request whose run cannot fit the pool at all)."""

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.kv.page_size)

    def _outstanding(self, req: Req) -> int:
        """Pages ``req`` may still take: to its last position (``max_new_tokens`` on, within
        the row width) plus a decode step's reservation, less the pages it owns."""
        end = min(len(req.prompt_ids) + req.params.max_new_tokens, self.kv.rows.max_context_len)
        return self._pages(end + self.reservation.reach) - self._pages(req.kv_allocated_len)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        room = self.kv.allocator.free_page_count - sum(map(self._outstanding, self.running))
        admissible = 0
        for req in self.waiting:
            need = self._outstanding(req)
            if need > room and (self.running or admissible):
                break
            room -= need
            admissible += 1
        queue = list(self.waiting)
        self.waiting = deque(queue[:admissible])
        try:
            return super()._schedule_prefill()
        finally:
            self.waiting.extend(queue[admissible:])

    def _retract(self, victim: Req) -> Req:
        raise RuntimeError(f"the queueing scheduler never retracts (asked to retract "
                           f"{victim.rid!r}): its admission left too little room")


class QueueingEngine(Engine):
    scheduler_class = QueueingScheduler


class QueueingBackend(RefEngineBackend):
    name = "queueing"
    engine_class = QueueingEngine

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), forced_retract=False)


def queueing_backend() -> QueueingBackend:
    return QueueingBackend()
