"""TokenAllocator (paged KV slots) and ReqToTokenPool (request rows): unit and property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from refengine.memory.allocator import DoubleFreeError, TokenAllocator
from refengine.memory.req_to_token import ReqToTokenPool


def free_set(alloc: TokenAllocator) -> set[int]:
    return set(alloc.backup_state().free_pages)


# --- TokenAllocator ---------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_fresh_allocator_counts(page_size: int) -> None:
    alloc = TokenAllocator(num_pages=9, page_size=page_size)
    assert alloc.capacity_slots == 8 * page_size
    assert alloc.free_slots == alloc.capacity_slots
    assert alloc.free_page_count == 8
    assert free_set(alloc) == set(range(1, 9))


@pytest.mark.parametrize("num_pages", [0, 1])
def test_needs_one_usable_page(num_pages: int) -> None:
    with pytest.raises(ValueError, match=r"^kv_pool_tokens"):
        TokenAllocator(num_pages, page_size=1)


def test_allocation_order_is_lowest_first_and_deterministic() -> None:
    alloc = TokenAllocator(num_pages=6, page_size=2)
    assert alloc.alloc_pages(3) == [1, 2, 3]
    alloc.free_pages([2, 1])
    assert alloc.alloc_pages(2) == [2, 1]  # freed pages come back first, in freeing order
    assert alloc.alloc_pages(2) == [4, 5]


def test_page_zero_is_never_handed_out() -> None:
    alloc = TokenAllocator(num_pages=5, page_size=4)
    pages = alloc.alloc_pages(4)
    assert pages is not None and 0 not in pages
    assert sorted(pages) == [1, 2, 3, 4]
    assert alloc.alloc_pages(1) is None
    assert alloc.free_slots == 0


def test_alloc_too_many_allocates_nothing() -> None:
    alloc = TokenAllocator(num_pages=4, page_size=1)
    before = alloc.backup_state()
    assert alloc.alloc_pages(4) is None
    assert alloc.backup_state() == before
    assert alloc.alloc_pages(0) == []
    assert alloc.alloc_pages(3) == [1, 2, 3]


def test_double_free_raises() -> None:
    alloc = TokenAllocator(num_pages=4, page_size=1)
    pages = alloc.alloc_pages(2)
    assert pages == [1, 2]
    alloc.free_pages([1])
    with pytest.raises(DoubleFreeError, match="page 1"):
        alloc.free_pages([1])
    with pytest.raises(DoubleFreeError, match="page 3"):
        alloc.free_pages([3])  # never allocated


@pytest.mark.parametrize("page", [0, -1, 4, 100])
def test_freeing_reserved_or_out_of_range_page_raises(page: int) -> None:
    alloc = TokenAllocator(num_pages=4, page_size=2)
    alloc.alloc_pages(3)
    with pytest.raises(DoubleFreeError):
        alloc.free_pages([page])
    assert alloc.free_page_count == 0


@pytest.mark.parametrize("bad", [[2, 2], [2, 0], [2, 3, 9]])
def test_rejected_free_changes_nothing(bad: list[int]) -> None:
    """A free that raises must leave the allocator exactly as it was (no page half-freed)."""
    alloc = TokenAllocator(num_pages=5, page_size=1)
    alloc.alloc_pages(3)
    before = alloc.backup_state()
    with pytest.raises(DoubleFreeError):
        alloc.free_pages(bad)
    assert alloc.backup_state() == before
    alloc.free_pages([1, 2, 3])  # every held page can still be freed exactly once
    assert free_set(alloc) == {1, 2, 3, 4}


# --- Hypothesis: random alloc / free / backup / restore sequences -----------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Model: the set of held pages. The allocator's free list must always be its complement."""

    held_pages = Bundle("held_pages")

    def __init__(self) -> None:
        super().__init__()
        self.alloc: TokenAllocator | None = None
        self.held: set[int] = set()

    @rule(num_pages=st.integers(2, 24), page_size=st.sampled_from([1, 2, 4, 16]))
    @precondition(lambda self: self.alloc is None)
    def create(self, num_pages: int, page_size: int) -> None:
        self.alloc = TokenAllocator(num_pages, page_size)

    @rule(target=held_pages, count=st.integers(0, 6))
    @precondition(lambda self: self.alloc is not None)
    def alloc_some(self, count: int) -> list[int]:
        assert self.alloc is not None
        free_before = self.alloc.free_page_count
        pages = self.alloc.alloc_pages(count)
        if count > free_before:
            assert pages is None
            assert self.alloc.free_page_count == free_before
            return []
        assert pages is not None and len(pages) == count
        assert len(set(pages)) == count
        assert 0 not in pages
        assert not set(pages) & self.held
        self.held |= set(pages)
        return pages

    @rule(pages=consumes(held_pages))
    def free_some(self, pages: list[int]) -> None:
        assert self.alloc is not None
        self.alloc.free_pages(pages)
        self.held -= set(pages)

    @rule(page=st.integers(-2, 30))
    @precondition(lambda self: self.alloc is not None)
    def double_free(self, page: int) -> None:
        assert self.alloc is not None
        if page in self.held:
            return
        before = self.alloc.backup_state()
        with pytest.raises(DoubleFreeError, match="freed twice"):
            self.alloc.free_pages([page])
        assert self.alloc.backup_state() == before

    @invariant()
    def conservation(self) -> None:
        if self.alloc is None:
            return
        free = free_set(self.alloc)
        assert len(free) == self.alloc.free_page_count  # no duplicates in the free list
        assert 0 not in free
        assert not free & self.held
        assert free | self.held == set(range(1, self.alloc.num_pages))
        assert self.alloc.free_slots == len(free) * self.alloc.page_size
        assert self.alloc.free_slots + len(self.held) * self.alloc.page_size == \
            self.alloc.capacity_slots


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- ReqToTokenPool ---------------------------------------------------------------------------


def test_rows_skip_row_zero_and_run_out() -> None:
    pool = ReqToTokenPool(rows=3, max_context_len=16, device="cpu")
    assert pool.table.shape == (4, 16)
    assert pool.free_rows == 3
    rows = [pool.alloc_row() for _ in range(3)]
    assert rows == [1, 2, 3]
    assert pool.alloc_row() is None
    assert pool.free_rows == 0
    pool.free_row(2)
    assert pool.alloc_row() == 2


@pytest.mark.parametrize("row", [0, -1, 4])
def test_row_free_outside_range_raises(row: int) -> None:
    pool = ReqToTokenPool(rows=3, max_context_len=8, device="cpu")
    for _ in range(3):
        pool.alloc_row()
    with pytest.raises(DoubleFreeError):
        pool.free_row(row)
    assert pool.free_rows == 0


def test_row_double_free_raises() -> None:
    pool = ReqToTokenPool(rows=2, max_context_len=8, device="cpu")
    row = pool.alloc_row()
    assert row is not None
    pool.free_row(row)
    with pytest.raises(DoubleFreeError, match=f"row {row}"):
        pool.free_row(row)
    assert pool.free_rows == 2


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 15)),
                                             max_size=60))
def test_row_pool_conservation(rows: int, ops: list[tuple[bool, int]]) -> None:
    pool = ReqToTokenPool(rows=rows, max_context_len=4, device="cpu")
    held: set[int] = set()
    for is_alloc, pick in ops:
        if is_alloc:
            row = pool.alloc_row()
            if len(held) == rows:
                assert row is None
            else:
                assert row is not None and row != 0 and row not in held
                held.add(row)
        elif pick in held:
            pool.free_row(pick)
            held.remove(pick)
        else:
            with pytest.raises(DoubleFreeError):
                pool.free_row(pick)
        assert pool.free_rows + len(held) == rows
