"""KVManager: extend / truncate / release over the row table and the paged allocator."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.config import SamplingParams
from refengine.memory import manager, req_to_token
from refengine.memory.manager import KVManager, MemoryCheckError
from refengine.memory.view import ceil_page
from refengine.request import Req

CONTEXT = 64


def make_manager(page_size: int, pool_tokens: int = 64, rows: int = 4) -> KVManager:
    return KVManager(pool_tokens, page_size, rows, CONTEXT, (1, 1, 2), torch.float32, "cpu")


def make_req(kv: KVManager, rid: str = "r0") -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(), seed=0, arrival=0)
    assert kv.assign_row(req)
    return req


def row_slots(kv: KVManager, req: Req) -> list[int]:
    assert req.row is not None
    return kv.rows.table[req.row, :req.kv_allocated_len].tolist()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunks", [[1] * 11, [3, 5, 1, 2], [11], [4, 4, 3], [2, 7, 1, 1]])
def test_extend_maps_positions_page_by_page(page_size: int, chunks: list[int]) -> None:
    kv = make_manager(page_size)
    req = make_req(kv)
    returned: list[int] = []
    for n in chunks:
        pages_before = kv.allocator.free_page_count
        start = req.kv_allocated_len
        slots = kv.extend(req, n)
        returned += slots.tolist()
        assert req.kv_allocated_len == start + n
        # New pages exactly when the extension crosses into a page the request does not own.
        new_pages = ceil_page(start + n, page_size) // page_size - ceil_page(start, page_size) \
            // page_size
        assert pages_before - kv.allocator.free_page_count == new_pages
    total = sum(chunks)
    assert row_slots(kv, req) == returned
    assert len(set(returned)) == total
    for pos, slot in enumerate(returned):
        assert slot >= page_size, "slot in the reserved page 0"
        assert slot % page_size == pos % page_size
        if pos % page_size:  # within a page, consecutive positions get consecutive slots
            assert slot == returned[pos - 1] + 1
    assert kv.capacity - kv.allocator.free_slots == ceil_page(total, page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_two_requests_never_share_a_page(page_size: int) -> None:
    kv = make_manager(page_size)
    a, b = make_req(kv, "a"), make_req(kv, "b")
    for n in [1, 2, 3, 1, 5]:
        kv.extend(a, n)
        kv.extend(b, n)
    pages_a = {s // page_size for s in row_slots(kv, a)}
    pages_b = {s // page_size for s in row_slots(kv, b)}
    assert not pages_a & pages_b
    assert 0 not in pages_a | pages_b


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("allocated", [1, 3, 4, 5, 9, 16])
def test_release_frees_whole_pages_and_row(page_size: int, allocated: int) -> None:
    kv = make_manager(page_size)
    req = make_req(kv)
    rows_before = kv.rows.free_rows
    kv.extend(req, allocated)
    req.kv_committed_len = allocated
    assert kv.allocator.free_slots == kv.capacity - ceil_page(allocated, page_size)
    kv.release(req)
    assert kv.allocator.free_slots == kv.capacity
    assert kv.rows.free_rows == rows_before + 1
    assert req.row is None
    assert req.kv_allocated_len == 0 and req.kv_committed_len == 0
    kv.release(req)  # releasing a request without a row is a no-op, not a double free
    assert kv.allocator.free_slots == kv.capacity


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("allocated", "keep"), [(9, 5), (9, 8), (9, 4), (8, 0), (3, 3)])
def test_truncate_keeps_whole_pages(page_size: int, allocated: int, keep: int) -> None:
    kv = make_manager(page_size)
    req = make_req(kv)
    kv.extend(req, allocated)
    prefix = row_slots(kv, req)[:keep]
    req.kv_committed_len = allocated
    kv.truncate(req, keep)
    assert req.kv_allocated_len == keep
    assert req.kv_committed_len == keep
    assert kv.capacity - kv.allocator.free_slots == ceil_page(keep, page_size)
    # Extending again continues the same mapping for the kept prefix.
    kv.extend(req, allocated - keep)
    assert row_slots(kv, req)[:keep] == prefix
    assert len(set(row_slots(kv, req))) == allocated
    assert kv.capacity - kv.allocator.free_slots == ceil_page(allocated, page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_needed_and_can_extend(page_size: int) -> None:
    kv = make_manager(page_size, pool_tokens=8)
    req = make_req(kv)
    assert kv.pages_needed(req, 0) == 0
    assert kv.pages_needed(req, 1) == 1
    assert kv.pages_needed(req, page_size + 1) == 2
    kv.extend(req, 1)
    assert kv.pages_needed(req, page_size - 1) == 0
    assert kv.pages_needed(req, page_size) == 1
    assert kv.can_extend([(req, 8 - 1)])
    assert not kv.can_extend([(req, 8)])


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_when_exhausted_changes_nothing(page_size: int) -> None:
    kv = make_manager(page_size, pool_tokens=8)
    req = make_req(kv)
    kv.extend(req, 5)
    before = (kv.allocator.backup_state(), req.kv_allocated_len, row_slots(kv, req))
    with pytest.raises(MemoryError, match="'r0'"):
        kv.extend(req, 4)
    assert (kv.allocator.backup_state(), req.kv_allocated_len, row_slots(kv, req)) == before


def test_extend_past_context_raises() -> None:
    kv = make_manager(1, pool_tokens=128)
    req = make_req(kv)
    kv.extend(req, CONTEXT - 1)
    with pytest.raises(ValueError, match=r"request 'r0': 65 positions exceed"):
        kv.extend(req, 2)
    assert req.kv_allocated_len == CONTEXT - 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_view_reports_live_requests(page_size: int) -> None:
    kv = make_manager(page_size)
    a, b = make_req(kv, "a"), make_req(kv, "b")
    kv.extend(a, 5)
    a.kv_committed_len = 5
    idle = Req("queued", [1], SamplingParams(), seed=0, arrival=2)  # no row: not in the view
    view = kv.view([a, b, idle], reserve_bound=0)
    assert set(view.requests) == {"a", "b"}
    assert (view.requests["a"].committed, view.requests["a"].allocated) == (5, 5)
    assert view.free == kv.capacity - ceil_page(5, page_size)
    assert view.rows_capacity == 4 and view.rows_free == 2
    kv.strict_check(kv.view([a, b, idle], reserve_bound=0))  # consistent accounting passes


def tampered_pair(page_size: int) -> tuple[KVManager, Req, Req]:
    kv = make_manager(page_size)
    good, victim = make_req(kv, "good"), make_req(kv, "victim-7")
    for r in (good, victim):
        kv.extend(r, 6)
        r.kv_committed_len = 6
    kv.strict_check(kv.view([good, victim], reserve_bound=0))  # untampered: passes
    return kv, good, victim


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tamper", ["committed_over", "committed_negative", "reserve_exceeded"])
def test_strict_check_names_request_with_broken_bounds(page_size: int, tamper: str) -> None:
    kv, good, victim = tampered_pair(page_size)
    if tamper == "committed_over":
        victim.kv_committed_len += 1          # committed > allocated
    elif tamper == "committed_negative":
        victim.kv_committed_len = -1
    else:
        victim.kv_committed_len -= 1          # allocated - committed = 1 > reserve_bound 0
    with pytest.raises(MemoryCheckError, match=r"^strict_mem_check: M2 bounds") as info:
        kv.strict_check(kv.view([good, victim], reserve_bound=0))
    assert "'victim-7'" in str(info.value)
    assert "good" not in str(info.value)
    if tamper == "reserve_exceeded":
        # within a looser bound it is legal
        kv.strict_check(kv.view([good, victim], reserve_bound=1))


def test_strict_check_allocated_within_page_is_a_bounds_error() -> None:
    """With page_size 4, allocated 6 -> 7 still owns two pages: M1 holds, M2 names the request."""
    kv, good, victim = tampered_pair(4)
    victim.kv_allocated_len += 1
    with pytest.raises(MemoryCheckError, match=r"^strict_mem_check: M2 bounds.*'victim-7'"):
        kv.strict_check(kv.view([good, victim], reserve_bound=0))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("delta", [-4, 4])
def test_strict_check_catches_slot_leak_or_overcount(page_size: int, delta: int) -> None:
    """A tampered allocated length that changes the pages a request owns breaks M1."""
    kv, good, victim = tampered_pair(page_size)
    victim.kv_allocated_len += delta
    victim.kv_committed_len += delta
    with pytest.raises(MemoryCheckError, match=r"^strict_mem_check: M1 conservation") as info:
        kv.strict_check(kv.view([good, victim], reserve_bound=0))
    owned = ceil_page(6, page_size) + ceil_page(6 + delta, page_size)
    assert f"owned {owned}" in str(info.value)
    assert f"capacity {kv.capacity}" in str(info.value)



@contextlib.contextmanager
def host_copies(module: Any = req_to_token) -> Iterator[list[int]]:
    """Counts the host-to-device copies of ``module`` (its ``from_host`` calls)."""
    calls = [0]
    original = module.from_host

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(*args, **kwargs)

    module.from_host = counting
    try:
        yield calls
    finally:
        module.from_host = original


@settings(max_examples=40, deadline=None)
@given(page_size=st.sampled_from([1, 4]),
       chunks=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=12))
def test_batched_writes_leave_the_table_as_one_write_per_extend_would(
        page_size: int, chunks: list[tuple[int, int]]) -> None:
    """The schedule phase's one row-table write: the same table and host copy as a write per
    extend, with one host-to-device copy for the whole block."""
    tables, copies = [], []
    for batched in (False, True):
        kv = make_manager(page_size, pool_tokens=128)
        reqs = [make_req(kv, f"r{i}") for i in range(4)]
        extends = 0
        block = kv.batched_writes() if batched else contextlib.nullcontext()
        with host_copies() as calls, block:
            for i, n in chunks:
                if reqs[i].kv_allocated_len + n <= CONTEXT:
                    kv.extend(reqs[i], n)
                    extends += 1
        copies.append(calls[0])
        tables.append(kv.rows.table.clone())
        assert all(kv.rows.table[r].tolist() == list(kv.rows.host[r]) for r in range(5))
    assert torch.equal(tables[0], tables[1])
    assert copies == [extends, min(extends, 1)]


def test_batched_writes_reach_the_table_when_the_block_raises() -> None:
    kv = make_manager(1, pool_tokens=16)
    req = make_req(kv)
    with pytest.raises(MemoryError), kv.batched_writes():
        kv.extend(req, 5)
        kv.extend(req, 20)  # more than the pool has left
    assert req.row is not None and req.kv_allocated_len == 5
    assert row_slots(kv, req) == list(kv.rows.host[req.row][:5])
    assert all(s > 0 for s in row_slots(kv, req))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4]))
def test_batched_moves_leave_the_pool_as_a_copy_per_path_would(data: st.DataObject,
                                                               page_size: int) -> None:
    """Tree paths of several requests resolved together: the same target pool as moving each
    path on its own, in one copy per pool tensor."""
    block = 6
    paths = [sorted(data.draw(st.sets(st.integers(1, block - 1), max_size=3))) for _ in range(3)]
    pools = []
    for batched in (False, True):
        kv = make_manager(page_size, pool_tokens=128)
        torch.manual_seed(0)
        kv.target_pool.k.normal_()
        kv.target_pool.v.normal_()
        reqs = [make_req(kv, f"r{i}") for i in range(3)]
        for req in reqs:
            kv.extend(req, 4 + block)
            kv.commit(req, 4)
        moves = kv.batched_moves() if batched else contextlib.nullcontext()
        with host_copies(manager) as calls, moves:
            for req, path in zip(reqs, paths, strict=True):
                kv.move_path(req, 4, [0, *path])
        pools.append((kv.target_pool.k.clone(), kv.target_pool.v.clone(), calls[0]))
    moved = sum(path != list(range(1, len(path) + 1)) for path in paths)
    (k0, v0, copies), (k1, v1, batched_copies) = pools
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert (copies, batched_copies) == (moved, min(moved, 1))


def test_batched_blocks_hold_back_only_their_own_threads_work() -> None:
    """An overlap step's launch thread moves KV while the engine's thread resolves inside its
    own block: the other thread's move and write happen at once, not at this block's end."""
    kv = make_manager(1, pool_tokens=128)
    req, other = make_req(kv, "r0"), make_req(kv, "r1")
    kv.extend(req, 8)
    kv.target_pool.k.normal_()
    with kv.batched_moves(), kv.batched_writes():
        worker = threading.Thread(target=lambda: (kv.move_path(req, 0, [0, 3]),
                                                  kv.extend(other, 4)))
        worker.start()
        worker.join()
        slots = row_slots(kv, req)
        assert torch.equal(kv.target_pool.k[:, slots[1]], kv.target_pool.k[:, slots[3]])
        assert row_slots(kv, other) == list(kv.rows.host[other.row][:4])
