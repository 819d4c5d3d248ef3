"""vLLM's KV accounting as the contract's ``MemoryView``, read from the scheduler's
``KVCacheManager`` after a step (docs/backends/vllm.md, "Memory view").

The mapping, in tokens (one vLLM block is one page of ``block_size`` tokens):

* ``capacity``: the pool's blocks minus the null block vLLM reserves for itself at start-up
  (``BlockPool.null_block``, never free, never owned by a request), times the block size;
* ``free``: ``BlockPool.get_num_free_blocks()`` times the block size (prefix caching is off,
  so a free block holds no reusable KV and no block is shared between requests);
* per live request holding blocks: ``committed`` = vLLM's ``num_computed_tokens`` (after a
  speculative step vLLM has already taken the rejected drafts back off it), ``allocated`` =
  its non-null blocks times the block size; ``phase`` "prefill" while fewer than
  ``num_tokens - 1`` positions are computed (a prompt, or a preempted request's recompute),
  else "decode". A request waiting with no blocks is left out (queued, holds no KV);
* ``reserve_bound``: how far a request's blocks may run ahead of its computed positions after
  a step: vLLM allocates at schedule time for the computed positions, the scheduled tokens
  (1 + the drafts) and the drafter's lookahead, rounded up to whole blocks, and keeps those
  blocks when the verify rejects drafts: ``block_size - 1 + num_spec + num_lookahead``;
* ``held`` is 0 (no sessions) and the row fields are 0: vLLM's scheduler has no request-row
  table (the worker's batch rows are not KV).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conformance.contract import MemoryView, ReqKV


@dataclass(frozen=True)
class PoolShape:
    """The fixed shape of vLLM's pool: ``block_size`` tokens a block, ``usable_blocks``
    (every block but the null block), and ``reserve_bound`` in tokens (module docstring)."""

    block_size: int
    usable_blocks: int
    reserve_bound: int


def pool_shape(scheduler: Any) -> PoolShape:
    """Read the pool's shape from vLLM's scheduler. Refuses a pool with more than one KV-cache
    group: each group then holds its own blocks per request from the same pool, which a
    token-count view cannot state faithfully (tiny-code, its EAGLE head and its draft model
    share one group, measured)."""
    kvm = scheduler.kv_cache_manager
    groups = kvm.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise RuntimeError(f"vllm backend: {len(groups)} KV-cache groups; the memory view "
                           f"maps a single group only")
    block_size = int(groups[0].kv_cache_spec.block_size)
    usable = int(kvm.block_pool.num_gpu_blocks) - 1  # the null block
    ahead = int(scheduler.num_spec_tokens) + int(scheduler.num_lookahead_tokens)
    return PoolShape(block_size, usable, block_size - 1 + ahead)


def _owned_blocks(kvm: Any, internal_id: str) -> int:
    """Blocks a request owns: its block list (one group), the null block left out."""
    (blocks,) = kvm.coordinator.get_blocks(internal_id)
    return sum(1 for b in blocks if not b.is_null)


def read_view(scheduler: Any, live: Mapping[str, str]) -> MemoryView:
    """The memory view after a step. ``live`` maps each live rid to vLLM's internal request
    id; only those requests are counted, so blocks vLLM still holds for a finished or aborted
    request are neither free nor owned and M1 reports them."""
    shape = pool_shape(scheduler)
    kvm = scheduler.kv_cache_manager
    size = shape.block_size
    requests: dict[str, ReqKV] = {}
    for rid, internal in live.items():
        blocks = _owned_blocks(kvm, internal)
        req = scheduler.requests.get(internal)
        if blocks == 0 or req is None:
            continue  # waiting (or never scheduled): holds no KV
        computed = int(req.num_computed_tokens)
        phase = "prefill" if computed < req.num_tokens - 1 else "decode"
        requests[rid] = ReqKV(committed=computed, allocated=blocks * size, phase=phase)
    return MemoryView(capacity=shape.usable_blocks * size,
                      free=int(kvm.block_pool.get_num_free_blocks()) * size, held=0,
                      page_size=size, requests=requests, reserve_bound=shape.reserve_bound)


@dataclass
class PreemptionWatch:
    """Turns vLLM's preemptions (recompute: blocks freed, ``num_computed_tokens`` reset, the
    request put back at the front of the waiting queue) into the contract's retractions, by
    the per-request counter ``Request.num_preemptions`` vLLM raises at each one."""

    seen: dict[str, int]

    def retracted(self, scheduler: Any, live: Mapping[str, str]) -> list[str]:
        """Live rids preempted since the last call, once per preemption, in ``live``'s order;
        forgets rids no longer live."""
        out: list[str] = []
        for rid, internal in live.items():
            req = scheduler.requests.get(internal)
            count = 0 if req is None else int(req.num_preemptions)
            out.extend([rid] * (count - self.seen.get(rid, 0)))
            self.seen[rid] = count
        for rid in set(self.seen) - set(live):
            del self.seen[rid]
        return out
