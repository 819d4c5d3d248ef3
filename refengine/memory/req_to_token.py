"""ReqToTokenPool: (request row, token position) -> KV slot.

Row 0 is a reserved dummy row (padded rows of a graph replay point there). A row belongs to at
most one live request; freeing a free row raises.

The table lives on the engine's device (every forward gathers its keys through it); a host copy,
one ``array`` of slots per row, answers the scheduler's reads (a page's next slot, the pages to
free) without a round-trip to the device. ``assign`` is the one writer and keeps both equal:
the host copy at once, the device table at once or, inside ``batched_writes``, in one write
when the block ends (a step's schedule phase assigns slots to every request of the batch, and
a write per request costs a GPU a host-to-device copy and a kernel launch each).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from refengine.device import from_host
from refengine.memory.allocator import DoubleFreeError


class ReqToTokenPool:
    def __init__(self, rows: int, max_context_len: int, device: str) -> None:
        self.usable_rows = rows  # usable rows, excluding the dummy row 0
        self.max_context_len = max_context_len
        self.table = torch.zeros((rows + 1, max_context_len), dtype=torch.int64, device=device)
        self.host = [array("q", bytes(8 * max_context_len)) for _ in range(rows + 1)]
        self._free: list[int] = list(range(rows, 0, -1))
        self._is_free = bytearray([0]) + bytearray([1]) * rows
        self._pending = threading.local()  # this thread's ``batched_writes`` queue, if any

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def assign(self, row: int, start: int, slots: list[int]) -> None:
        """Positions ``start, start + 1, ..`` of ``row`` hold ``slots`` (host copy at once,
        device table at once or at the end of ``batched_writes``)."""
        self.host[row][start:start + len(slots)] = array("q", slots)
        queued: list[tuple[int, int, list[int]]] | None = getattr(self._pending, "writes", None)
        if queued is None:
            self.table[row, start:start + len(slots)] = from_host(slots, self.table.device)
        else:
            queued.append((row, start, slots))

    @contextmanager
    def batched_writes(self) -> Iterator[None]:
        """Every ``assign`` inside reaches the device table in one write at the end (also when
        the block raises: the host copy already holds them). Positions written twice in one
        block would race in the one write; the callers assign each position once (a request's
        new positions lie past its allocation, which every assign advances). Per thread: only
        this thread's assignments wait for its block."""
        if getattr(self._pending, "writes", None) is not None:  # nested: the outer block writes
            yield
            return
        queued: list[tuple[int, int, list[int]]] = []
        self._pending.writes = queued
        try:
            yield
        finally:
            self._pending.writes = None
            if queued:
                rows = [row for row, _, slots in queued for _ in slots]
                columns = [start + j for _, start, slots in queued for j in range(len(slots))]
                packed = from_host([rows, columns, [s for *_, slots in queued for s in slots]],
                                   self.table.device)
                self.table.index_put_((packed[0], packed[1]), packed[2])

    def alloc_row(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._is_free[row] = 0
        return row

    def free_row(self, row: int) -> None:
        if not 0 < row <= self.usable_rows or self._is_free[row]:
            raise DoubleFreeError(f"request row {row} freed twice or never allocatable")
        self._is_free[row] = 1
        self._free.append(row)
