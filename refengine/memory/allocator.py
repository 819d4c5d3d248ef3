"""TokenAllocator: hands out KV slots one page at a time.

Invariants (checked, not assumed):
- page 0 (slots ``0 .. page_size-1``) is a reserved dummy: never handed out, never freed, so a
  padded row of a graph replay can point there harmlessly;
- every other page is either in the free list or owned by exactly one holder; freeing a page
  that is already free (a double free) raises instead of corrupting the free list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class DoubleFreeError(RuntimeError):
    """A page was freed while already free (or was never allocatable)."""


@dataclass(frozen=True)
class AllocatorState:
    free_pages: tuple[int, ...]
    is_free: bytes


class TokenAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"kv_pool_tokens: room for at least one page besides the reserved "
                             f"one is needed, got {num_pages - 1} usable pages")
        self.page_size = page_size
        self.num_pages = num_pages
        # A stack whose top is the lowest page id, so allocation order is deterministic.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray([0]) + bytearray([1]) * (num_pages - 1)

    @property
    def capacity_slots(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.page_size

    @property
    def free_page_count(self) -> int:
        return len(self._free)

    def alloc_pages(self, count: int) -> list[int] | None:
        """``count`` pages, or None (and nothing allocated) when not enough are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free_pages(self, pages: Sequence[int]) -> None:
        # Validate the whole call before changing anything: a rejected free (a page already
        # free, repeated within ``pages``, or out of range) must leave the allocator as it was,
        # not with earlier pages marked free yet missing from the free list (leaked for good).
        seen: set[int] = set()
        for page in pages:
            if not 0 < page < self.num_pages or self._is_free[page] or page in seen:
                raise DoubleFreeError(f"page {page} freed twice or never allocatable "
                                      f"(page_size={self.page_size})")
            seen.add(page)
        for page in pages:
            self._is_free[page] = 1
        self._free.extend(reversed(pages))

    def backup_state(self) -> AllocatorState:
        """A snapshot of the free list, for comparisons (a probe or test that must leave the
        allocator exactly as it found it)."""
        return AllocatorState(tuple(self._free), bytes(self._is_free))
