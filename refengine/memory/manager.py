"""KVManager: per-request KV bookkeeping over the row table, the allocator and the KV pool.

A request's positions ``0 .. allocated-1`` map to slots through its row in ``req_to_token``;
slots come in whole pages, so a request owns ``ceil_page(allocated)`` slots.

The manager is the only code that changes ``kv_allocated_len`` and ``kv_committed_len``, and
the only code that moves KV between slots (``move_path``, ``commit_path``); the models write the
KV of the tokens they run, at the slots the runner hands them. Its bookkeeping mutators are
called from the schedule phase (``Scheduler``: allocation, reservation, retraction) and the
resolve phase (``OutputProcessor``, sessions: commit and release) only
(``tests/test_kv_writer_rule.py``). Invariant kept here, between steps:
``kv_committed_len <= kv_allocated_len``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from refengine.device import from_host
from refengine.memory.allocator import TokenAllocator
from refengine.memory.kv_pool import KVPool
from refengine.memory.req_to_token import ReqToTokenPool
from refengine.memory.reservation import DecodeReservation
from refengine.memory.view import (
    MemoryView,
    ReqKV,
    bounds_error,
    conservation_error,
)
from refengine.request import Req


class MemoryCheckError(AssertionError):
    """The engine's strict memory check (M6) found broken accounting."""


class KVManager:
    def __init__(self, kv_pool_tokens: int, page_size: int, max_running_requests: int,
                 max_context_len: int, kv_shape: tuple[int, int, int], dtype: torch.dtype,
                 device: str, draft_layers: int = 0, row_headroom: int = 0) -> None:
        """``draft_layers``: layers of a draft KV pool sharing this allocator and row table
        (EAGLE), so a slot names the same position in both. ``row_headroom``: extra row width
        for speculative positions past the context end (draft scratch, the verify block)."""
        num_pages = kv_pool_tokens // page_size + 1  # + the reserved page 0
        self.page_size = page_size
        self.allocator = TokenAllocator(num_pages, page_size)
        self.rows = ReqToTokenPool(max_running_requests, max_context_len + row_headroom, device)
        layers, kv_heads, head_dim = kv_shape
        self.target_pool = KVPool(num_pages * page_size, layers, kv_heads, head_dim, dtype, device)
        self.draft_pool = (KVPool(num_pages * page_size, draft_layers, kv_heads, head_dim, dtype,
                                device) if draft_layers else None)
        # The moves queued by this thread's ``batched_moves`` block: per thread, since an
        # overlap step's launch thread moves KV while the engine's thread resolves.
        self._pending = threading.local()

    @property
    def device(self) -> torch.device:
        """Where the KV tensors and the row table live: every tensor a forward reads."""
        return self.rows.table.device

    @property
    def capacity(self) -> int:
        return self.allocator.capacity_slots

    def pages_needed(self, req: Req, new_tokens: int) -> int:
        ps = self.page_size
        return -(-(req.kv_allocated_len + new_tokens) // ps) - (-(-req.kv_allocated_len // ps))

    def can_extend(self, reqs: list[tuple[Req, int]]) -> bool:
        need = sum(self.pages_needed(r, n) for r, n in reqs)
        return need <= self.allocator.free_page_count

    def assign_row(self, req: Req) -> bool:
        row = self.rows.alloc_row()
        if row is None:
            return False
        req.row = row
        return True

    def extend(self, req: Req, new_tokens: int) -> torch.Tensor:
        """Reserve slots for the next ``new_tokens`` positions; -> those positions of the row
        table (their slot ids; a view, which inside ``batched_writes`` holds them only once
        the block has ended)."""
        start = req.kv_allocated_len
        self.grow(req, new_tokens)
        assert req.row is not None
        return self.rows.table[req.row, start:start + new_tokens]

    def grow(self, req: Req, new_tokens: int) -> None:
        """``extend`` for a caller that does not read the slots (the schedule phase's
        reservations: no view of the table made per request)."""
        ps, start = self.page_size, req.kv_allocated_len
        end = start + new_tokens
        if end > self.rows.max_context_len:
            raise ValueError(f"request {req.rid!r}: {end} positions exceed the row width "
                             f"{self.rows.max_context_len}")
        pages = self.allocator.alloc_pages(self.pages_needed(req, new_tokens))
        if pages is None:
            raise MemoryError(f"request {req.rid!r}: KV pool exhausted (asked for {new_tokens} "
                              f"tokens, {self.allocator.free_slots} slots free)")
        # First the rest of the last page the request already owns, then the new pages.
        tail = min(new_tokens, -start % ps)
        first = self.rows.host[req.row][start - 1] + 1 if tail else 0
        slot_list = list(range(first, first + tail))
        for page in pages:
            slot_list.extend(range(page * ps, page * ps + ps))
        self.rows.assign(req.row, start, slot_list[:new_tokens])
        req.kv_allocated_len = end

    def batched_writes(self) -> AbstractContextManager[None]:
        """The row-table writes of every ``extend`` inside as one device write at its end
        (``ReqToTokenPool.batched_writes``): what the schedule phase wraps its batch in."""
        return self.rows.batched_writes()

    def block_slot_lists(self, reqs: list[Req], starts: list[int], tokens: int
                         ) -> list[list[int]]:
        """The slots of positions ``starts[i] .. starts[i] + tokens - 1`` of each request,
        which it already holds (a verify block or draft scratch reserved before its step), as
        host lists: read from the table's host copy (equal to it: ``ReqToTokenPool``), so the
        caller copies them to the device once, with its other small lists, instead of
        gathering them there."""
        host = self.rows.host
        return [host[r.row][s:s + tokens].tolist() for r, s in zip(reqs, starts, strict=True)]

    def run_slots(self, reqs: list[Req], starts: list[int], lens: list[int]) -> torch.Tensor:
        """Flat, in request order: the slots of positions ``starts[i] .. starts[i] + lens[i] -
        1`` of each request, which it holds. Read from the table's host copy like
        ``block_slot_lists``: one copy for the batch, not a view and a gather per request."""
        runs = []
        for r, s, n in zip(reqs, starts, lens, strict=True):
            if s + n > r.kv_allocated_len:
                raise RuntimeError(f"request {r.rid!r}: positions up to {s + n} asked, "
                                   f"only {r.kv_allocated_len} allocated")
            runs.extend(self.rows.host[r.row][s:s + n])
        return from_host(runs, self.device)

    @contextmanager
    def scoring(self, req: Req, tokens: int) -> Iterator[torch.Tensor]:
        """A row and ``tokens`` slots for a scoring forward outside the step loop, yielded as
        the slots; on exit the request's row and slots are released again."""
        if not self.assign_row(req):
            raise RuntimeError("next_token_logits: no free request row")
        try:
            yield self.extend(req, tokens)
        finally:
            self.release(req)

    def commit(self, req: Req, new_tokens: int) -> None:
        """The forward that just ran wrote KV for ``new_tokens`` more positions."""
        end = req.kv_committed_len + new_tokens
        if end > req.kv_allocated_len:
            raise RuntimeError(f"request {req.rid!r}: committing {end} positions, only "
                               f"{req.kv_allocated_len} allocated")
        req.kv_committed_len = end

    def commit_path(self, req: Req, nodes: list[int]) -> None:
        """Keep a verified path: ``nodes`` are the accepted block offsets (root first) of the
        verify block written at positions ``committed ..``; their KV moves to the contiguous
        positions ``committed, committed + 1, ..`` (a chain's path already sits there), they
        are committed, and the rest of the block is freed (whole pages only)."""
        self.move_path(req, req.kv_committed_len, nodes)
        self.commit(req, len(nodes))
        self.truncate(req, req.kv_committed_len)

    def move_path(self, req: Req, start: int, nodes: list[int]) -> None:
        """Move the KV of the accepted block offsets ``nodes`` (root first) of a verify block
        written at positions ``start ..`` to the contiguous positions ``start, start + 1, ..``.
        A chain's path already sits there. Lengths are not touched (the overlap path commits
        one step later). Inside ``batched_moves`` the copy waits for the block's end."""
        if nodes == list(range(len(nodes))):
            return
        assert req.row is not None
        host = self.rows.host[req.row]  # equal to the device table (``ReqToTokenPool``)
        src = [host[start + j] for j in nodes]
        dst = [host[start + i] for i in range(len(nodes))]
        queued: tuple[list[int], list[int]] | None = getattr(self._pending, "moves", None)
        if queued is None:
            self._copy_slots(src, dst)
        else:
            queued[0].extend(src)
            queued[1].extend(dst)

    @contextmanager
    def batched_moves(self) -> Iterator[None]:
        """Every ``move_path`` inside as one gather and one scatter per pool tensor at the end
        (also when the block raises): a batch of tree paths resolved together, where a copy per
        request costs a GPU about six launches. Requests hold disjoint slots, so their moves
        commute; one request's sources are all read before its destinations are written, as
        in a copy of its own. Per thread: only this thread's moves wait for its block."""
        if getattr(self._pending, "moves", None) is not None:  # nested: the outer block copies
            yield
            return
        src: list[int] = []
        dst: list[int] = []
        self._pending.moves = src, dst
        try:
            yield
        finally:
            self._pending.moves = None
            if src:
                self._copy_slots(src, dst)

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        """The target pool's KV of slots ``src`` into slots ``dst`` (all read, then written)."""
        moves = from_host([src, dst], self.device)
        self.target_pool.k[:, moves[1]] = self.target_pool.k[:, moves[0]]
        self.target_pool.v[:, moves[1]] = self.target_pool.v[:, moves[0]]

    def top_up(self, req: Req, reservation: DecodeReservation) -> int:
        """Positions past its allocation ``reserve`` will add for ``req``."""
        return max(0, reservation.end(req.kv_committed_len, self.page_size)
                   - req.kv_allocated_len)

    def reserve(self, req: Req, reservation: DecodeReservation) -> None:
        """At schedule time: grow ``req``'s allocation to hold its next decode step's
        reservation and, where the reservation says so, pre-claim the root's slot (commit it
        ahead of the step's resolution)."""
        need = self.top_up(req, reservation)
        if need:
            self.grow(req, need)
        if reservation.preclaim_root:
            self.commit(req, 1)

    @contextmanager
    def reserved(self, reqs: list[Req], reservation: DecodeReservation) -> Iterator[None]:
        """``reqs`` (committed, in no step) reserved as for a decode step, for a probe that runs
        a step's forwards outside the loop; on exit a pre-claim is undone (the allocation
        stays: the caller truncates it)."""
        with self.batched_writes():
            for req in reqs:
                self.reserve(req, reservation)
        try:
            yield
        finally:
            if reservation.preclaim_root:
                for req in reqs:
                    self.unclaim(req)

    def unclaim(self, req: Req) -> None:
        """Undo ``reserve``'s pre-claim: the step it was made for was never
        resolved for ``req`` (the request finished while that step was in flight)."""
        if req.kv_committed_len < 1:
            raise RuntimeError(f"request {req.rid!r}: no pre-claimed slot to roll back")
        req.kv_committed_len -= 1

    def truncate(self, req: Req, keep_tokens: int) -> None:
        """Release reserved positions beyond ``keep_tokens`` (whole pages only)."""
        self._free_positions(req.row, keep_tokens, req.kv_allocated_len)
        req.kv_allocated_len = keep_tokens
        req.kv_committed_len = min(req.kv_committed_len, keep_tokens)

    def _free_positions(self, row: int | None, keep_tokens: int, have_tokens: int) -> None:
        """Free the pages of ``row`` past the ones positions ``0 .. keep_tokens-1`` use."""
        ps = self.page_size
        keep_pages, have_pages = -(-keep_tokens // ps), -(-have_tokens // ps)
        if row is not None and have_pages > keep_pages:
            first = self.rows.host[row][keep_pages * ps: have_pages * ps: ps]
            self.allocator.free_pages([slot // ps for slot in first])

    def release(self, req: Req) -> None:
        """Free a request's slots and its row (finish, abort, retraction)."""
        if req.row is None:
            return
        self.truncate(req, 0)
        self.rows.free_row(req.row)
        req.row = None

    def retract(self, req: Req) -> None:
        """Memory pressure: free what ``req`` holds, except a session turn's inherited prefix
        (earlier turns' KV), which it keeps with its row and re-prefills from."""
        if req.cached_prefix:
            self.truncate(req, req.cached_prefix)
        else:
            self.release(req)

    # --- streaming sessions: a row and its committed prefix outlive the request ---------------

    def lend(self, req: Req, row: int, cached: int) -> None:
        """A session's next turn takes over the row holding ``cached`` committed positions."""
        req.row = row
        req.kv_allocated_len = req.kv_committed_len = req.cached_prefix = cached

    def keep(self, req: Req, length: int) -> int | None:
        """A session turn ends: keep its first ``length`` committed positions (and their row)
        for the session, free the rest; returns the row, or None when nothing is kept."""
        if length > req.kv_committed_len:
            raise RuntimeError(f"request {req.rid!r}: keeping {length} positions, only "
                               f"{req.kv_committed_len} committed")
        if length == 0:
            self.release(req)
            return None
        self.truncate(req, length)
        row, req.row = req.row, None
        req.kv_allocated_len = req.kv_committed_len = 0
        return row

    def free_kept(self, row: int, length: int) -> None:
        """Close a session: free the row ``keep`` returned and its ``length`` positions."""
        self._free_positions(row, 0, length)
        self.rows.free_row(row)

    def view(self, live: list[Req], reserve_bound: int, held: int = 0,
             rows_held: int = 0) -> MemoryView:
        """``held``/``rows_held``: slots and rows owned by no live request (sessions' kept KV,
        finished requests whose release waits for an in-flight step)."""
        return MemoryView(
            capacity=self.capacity, free=self.allocator.free_slots, held=held,
            page_size=self.page_size,
            requests={r.rid: ReqKV(r.kv_committed_len, r.kv_allocated_len, r.kv_phase)
                      for r in live if r.row is not None},
            rows_capacity=self.rows.usable_rows, rows_free=self.rows.free_rows, rows_held=rows_held,
            reserve_bound=reserve_bound)

    def strict_check(self, view: MemoryView) -> None:
        """M6: M1 and M2 inside the engine, naming the request and the numbers."""
        problem = conservation_error(view) or bounds_error(view)
        if problem:
            raise MemoryCheckError(f"strict_mem_check: {problem}")
