"""Overlap-scheduling (EAGLE V2) mutants: stale results applied, an abort that keeps its
reservation, a commit made late."""

from __future__ import annotations

from dataclasses import replace

from refengine import Engine
from refengine.memory.manager import KVManager
from refengine.memory.reservation import DecodeReservation
from refengine.memory.view import ceil_page
from refengine.output import OutputProcessor
from refengine.request import Req
from refengine.step import StepResult

# --- overlap scheduling (EAGLE V2) ---------------------------------------------------------------

class _AppliesStaleResults(OutputProcessor):
    def is_stale(self, result: StepResult, i: int) -> bool:
        return False  # BUG: a late result is applied whatever happened to its request


class StaleResultApplied(Engine):
    """Stale result: an overlap step's result is applied to a request that finished, was
    aborted or retracted after the step was launched (tokens for a dead request, acceptance
    counted, KV committed that is no longer its own)."""

    output_class = _AppliesStaleResults


class _AbortKeepsReservation(KVManager):
    def release(self, req: Req) -> None:
        if req.finish_reason == "abort" and req.row is not None:
            # BUG: the abort path frees only what is committed; the reservation past it is
            # forgotten, never returned to the pool.
            req.kv_allocated_len = ceil_page(req.kv_committed_len, self.page_size)
        super().release(req)


class AbortLeaksReservation(Engine):
    """Over-allocation not freed on abort: an aborted request's overlap reservation past its
    committed end leaks (invisible without a reservation, i.e. under V1)."""

    kv_manager_class = _AbortKeepsReservation


class _NoPreClaim(KVManager):
    def reserve(self, req: Req, reservation: DecodeReservation) -> None:
        if not reservation.preclaim_root:
            super().reserve(req, reservation)
            return
        # The same reservation end as the reference (committed + 1 + 2L, the root included),
        # but the root's slot is not pre-claimed: resolution commits the whole run instead.
        super().reserve(req, replace(reservation, block=reservation.block - 1,
                                     preclaim_root=False))


class _CommitsWholeRunLate(OutputProcessor):
    def commit_run(self, req: Req, nodes: list[int], overlap: bool) -> None:
        if overlap:
            self.kv.commit(req, len(nodes))  # the root included, one step after its launch
            return
        super().commit_run(req, nodes, overlap)


class LateCommit(Engine):
    """Late commit under overlap scheduling: a step's KV (its root included) is committed only
    when the step is resolved, instead of pre-claiming the root at schedule time. A turn that
    finishes while its next step is in flight ends one token short, so its streaming session
    inherits a cached prefix one short."""

    kv_manager_class = _NoPreClaim
    output_class = _CommitsWholeRunLate
