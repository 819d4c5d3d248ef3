"""ReqToTokenPool: (request row, token position) -> KV slot.

Row 0 is a reserved dummy row (padded rows of a graph replay point there). A row belongs to at
most one live request; freeing a free row raises.

The table lives on the engine's device (every forward gathers its keys through it); a host copy,
one ``array`` of slots per row, answers the scheduler's reads (a page's next slot, the pages to
free) without a round-trip to the device. ``assign`` is the one writer and keeps both equal.
"""

from __future__ import annotations

from array import array

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

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def assign(self, row: int, start: int, slots: list[int]) -> torch.Tensor:
        """Positions ``start, start + 1, ..`` of ``row`` hold ``slots`` (table and host copy);
        -> the slots as a tensor on the table's device."""
        self.host[row][start:start + len(slots)] = array("q", slots)
        values = from_host(slots, self.table.device)
        self.table[row, start:start + len(slots)] = values
        return values

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
