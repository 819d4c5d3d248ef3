"""Mutants of KV and request-row bookkeeping: leaks on finish and abort, a request that stays
running after abort, stale committed lengths after retraction, a decode step's room counted
without the draft scratch."""

from __future__ import annotations

from dataclasses import replace

from refengine import Engine
from refengine.memory.manager import KVManager
from refengine.request import Req
from refengine.scheduler import Scheduler


class _LeakLastPage(KVManager):
    def release(self, req: Req) -> None:
        if req.row is not None and req.finish_reason in ("stop", "length"):
            # The page loop stops one page short; the row is returned, the page never is.
            self.truncate(req, self.page_size)
            self.rows.free_row(req.row)
            req.row = None
            return
        super().release(req)


class LeakOnFinish(Engine):
    """KV slots leak by one page per finished request."""

    kv_manager_class = _LeakLastPage


class _AbortKeepsRow(KVManager):
    def release(self, req: Req) -> None:
        if req.finish_reason == "abort" and req.row is not None:
            self.truncate(req, 0)
            req.row = None  # the row is dropped without going back to the pool
            return
        super().release(req)


class AbortLeaksRow(Engine):
    """Abort returns the KV slots but not the request row."""

    kv_manager_class = _AbortKeepsRow


class _AbortStaysRunning(Scheduler):
    def remove(self, req: Req) -> None:
        if req.finish_reason == "abort" and req in self.running:
            return  # BUG: the aborted request is never taken off the running list
        super().remove(req)


class AbortStaysRunning(Engine):
    """An aborted request stays in the running list: it no longer decodes, but it keeps its
    running slot (and a retraction may pick it and bring it back to life)."""

    scheduler_class = _AbortStaysRunning


class _ReleaseKeepsCommitted(KVManager):
    def release(self, req: Req) -> None:
        committed = req.kv_committed_len
        super().release(req)
        if req.finish_reason is None:  # a retraction (finish and abort set a reason first)
            req.kv_committed_len = committed  # stale: the re-prefill skips what it "has"


class RetractStaleCommitted(Engine):
    """Retraction frees the KV but leaves the committed length behind."""

    kv_manager_class = _ReleaseKeepsCommitted


class _RoomForVerifyBlockOnly(Scheduler):
    def top_up(self, req: Req) -> int:
        # BUG: the room is counted for the verify block alone; the draft scratch past it (when
        # longer) is reserved all the same, from pages the room check never saw.
        return self.kv.top_up(req, replace(self.reservation, scratch=0))


class RoomCountsVerifyBlockOnly(Engine):
    """The scheduler finds room for a decode step's verify block but not for the draft scratch
    where that is longer (a tree whose levels hold more than its verify block): under pool
    pressure it schedules a step the pool cannot hold."""

    scheduler_class = _RoomForVerifyBlockOnly
