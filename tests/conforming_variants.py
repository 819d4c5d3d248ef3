"""Test-only backends that model what the adapter contract allows a backend to do differently
from the reference engine, each the reference engine behind an adapter that changes one
thing. The suite must certify every one of them with no failed check: a check whose
precondition such a backend cannot meet is not applicable (or gated on a capability it does
not claim), never failed (``tests/test_conforming_variants.py``).

Named on the command line as ``--backend tests.conforming_variants:<factory>``:

* ``whole_prefill``: prefills every prompt whole and streams its first token in the same
  step; does not claim ``chunked_prefill`` (``max_prefill_tokens`` is ignored);
* ``run_to_completion``: one ``step()`` runs everything submitted to completion (not
  ``stepwise``; no abort, memory view, sessions or anything else that acts between steps);
* ``no_memory_view``: stepwise, but keeps its KV accounting to itself (no ``memory_view``;
  the pool and page size it is asked for are ignored);
* ``queueing``: meets memory pressure by queueing instead of retracting. It admits a waiting
  request only when the KV pool can hold its whole run (prompt plus ``max_new_tokens`` and a
  decode step's reservation) beside what the running requests may still grow to, so it never
  retracts; it does not claim ``forced_retract``;
* ``queueing_lists_waiting``: ``queueing``, with its waiting requests listed in the memory view
  with zero KV rather than left out (the contract allows either);
* ``fixed_pages``: pool pages must be a multiple of ``FIXED_PAGE`` tokens (as vLLM's CPU
  attention takes multiples of 32 only): declares ``page_multiple`` and refuses any other
  page size (``Capabilities.page_multiple``, docs/adapter.md);
* ``no_abort``: stepwise, but a submitted request runs to its finish: does not claim ``abort``
  (``handle.abort`` raises).

The reference engine computing in bfloat16 and declaring it is ``tests.test_near_ties:
bfloat16_honest``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import (
    Capabilities,
    Event,
    FinishEvent,
    MemoryView,
    OpenConfig,
    ReqKV,
    Request,
)
from refengine import Engine
from refengine.request import Req
from refengine.scheduler import ScheduledBatch, Scheduler

# Larger than any prompt and any batch of them: every prompt is prefilled whole, in one step.
UNLIMITED_PREFILL = 1 << 30


class WholePrefillBackend(RefEngineBackend):
    name = "variant:whole_prefill"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), chunked_prefill=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"chunked_prefill": "every prompt is prefilled whole, in the step that admits it"}

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        return super().open(replace(cfg, max_prefill_tokens=UNLIMITED_PREFILL))


class NoMemoryViewHandle(RefEngineHandle):
    def memory(self) -> MemoryView:
        raise NotImplementedError("this backend keeps its KV accounting to itself")


class NoMemoryViewBackend(RefEngineBackend):
    name = "variant:no_memory_view"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), memory_view=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"memory_view": "the KV pool is internal: no per-request accounting to show"}

    def open(self, cfg: OpenConfig) -> NoMemoryViewHandle:
        handle = super().open(replace(cfg, kv_pool_tokens=None, page_size=None))
        return NoMemoryViewHandle(handle.engine)


class RunToCompletionHandle(RefEngineHandle):
    """``step()`` runs the engine until every request submitted so far has finished."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.unfinished: set[str] = set()

    def submit(self, req: Request) -> None:
        super().submit(req)
        self.unfinished.add(req.rid)

    def step(self) -> list[Event]:
        events: list[Event] = []
        while self.unfinished:
            for event in self.engine.step():
                events.append(event)
                if isinstance(event, FinishEvent):
                    self.unfinished.discard(event.rid)
        return events


NOT_BETWEEN_STEPS = "one step() runs every request to completion: nothing happens between steps"


class RunToCompletionBackend(RefEngineBackend):
    name = "variant:run_to_completion"
    BETWEEN_STEPS = ("stepwise", "abort", "memory_view", "sessions", "forced_retract",
                     "in_flight", "worker_hooks", "graph_runner", "chunked_prefill")

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), kernels=False,
                       **dict.fromkeys(self.BETWEEN_STEPS, False))

    def unclaimed_reasons(self) -> dict[str, str]:
        return {**dict.fromkeys(self.BETWEEN_STEPS, NOT_BETWEEN_STEPS),
                "kernels": "its kernels are not handed out"}

    def open(self, cfg: OpenConfig) -> RunToCompletionHandle:
        return RunToCompletionHandle(super().open(cfg).engine)


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
    name = "variant:queueing"
    engine_class = QueueingEngine

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), forced_retract=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"forced_retract": "it never retracts: it admits a request only when its whole "
                                  "run fits"}


class ListsWaitingHandle(RefEngineHandle):
    """The memory view lists every waiting request that holds no KV, with zero KV."""

    def memory(self) -> MemoryView:
        view = self.engine.memory()
        queued = {r.rid: ReqKV(0, 0, "prefill") for r in self.engine.scheduler.waiting
                  if r.rid not in view.requests}
        return replace(view, requests={**view.requests, **queued})


class QueueingListsWaitingBackend(QueueingBackend):
    name = "variant:queueing_lists_waiting"

    def open(self, cfg: OpenConfig) -> ListsWaitingHandle:
        return ListsWaitingHandle(super().open(cfg).engine)


FIXED_PAGE = 32


class FixedPagesBackend(RefEngineBackend):
    name = "variant:fixed_pages"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), page_multiple=FIXED_PAGE)

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        if cfg.page_size is not None and cfg.page_size % FIXED_PAGE:
            raise ValueError(f"page_size: pages of a multiple of {FIXED_PAGE} tokens only, "
                             f"not {cfg.page_size}")
        return super().open(cfg)


def whole_prefill() -> WholePrefillBackend:
    return WholePrefillBackend()


def no_memory_view() -> NoMemoryViewBackend:
    return NoMemoryViewBackend()


def run_to_completion() -> RunToCompletionBackend:
    return RunToCompletionBackend()


def queueing() -> QueueingBackend:
    return QueueingBackend()


def queueing_lists_waiting() -> QueueingListsWaitingBackend:
    return QueueingListsWaitingBackend()


def fixed_pages() -> FixedPagesBackend:
    return FixedPagesBackend()


class NoAbortHandle(RefEngineHandle):
    def abort(self, rid: str) -> None:
        raise NotImplementedError("a submitted request runs to its finish")


class NoAbortBackend(RefEngineBackend):
    name = "variant:no_abort"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), abort=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"abort": "a submitted request runs to its finish"}

    def open(self, cfg: OpenConfig) -> NoAbortHandle:
        return NoAbortHandle(super().open(cfg).engine)


def no_abort() -> NoAbortBackend:
    return NoAbortBackend()


class ClaimsChunkedPrefillWithout(WholePrefillBackend):
    """Not a conforming variant: claims ``chunked_prefill`` and prefills whole anyway. The
    check that needs the claim must fail it."""

    name = "variant:claims_chunked_prefill_without"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), chunked_prefill=True)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {}


def claims_chunked_prefill_without() -> ClaimsChunkedPrefillWithout:
    return ClaimsChunkedPrefillWithout()


class IgnoresPageSize(RefEngineBackend):
    """Not a conforming variant: claims ``memory_view`` and runs pages of one token whatever
    page size it is asked. The driver's page-size check must fail it."""

    name = "variant:ignores_page_size"

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        return super().open(replace(cfg, page_size=None))


def ignores_page_size() -> IgnoresPageSize:
    return IgnoresPageSize()
