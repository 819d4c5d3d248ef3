"""Mutants of retraction's bookkeeping outside KV: where a retracted request waits, and whether
the retraction is reported at all. Outputs and memory stay right in both."""

from __future__ import annotations

from refengine import Engine
from refengine.request import Req
from refengine.scheduler import ScheduledBatch, Scheduler


class _RequeueAtBack(Scheduler):
    def _retract(self, victim: Req) -> Req:
        super()._retract(victim)
        # BUG: re-queued behind every waiting request instead of ahead of them
        self.waiting.remove(victim)
        self.waiting.append(victim)
        return victim


class RetractRequeuedAtBack(Engine):
    """A retracted request is re-queued at the back of the waiting queue: every request
    submitted after it is admitted first, and under steady arrivals it waits unboundedly."""

    scheduler_class = _RequeueAtBack


class _SilentWhenAllRetracted(Scheduler):
    def _schedule_decode(self) -> ScheduledBatch | None:
        batch = super()._schedule_decode()
        if batch is not None and not batch.reqs:
            return None  # BUG: every decoding request retracted: the step reports nothing
        return batch


class RetractUnreported(Engine):
    """A step that retracts every decoding request (a lone request under pressure or forced
    retraction) reports no RetractEvent: the request's KV is gone, and the event stream says
    nothing of it."""

    scheduler_class = _SilentWhenAllRetracted
