"""The graph probe's world: the engine state every case of a seed runs on.

Every case runs on a *world* -- ``max_batch`` requests with different prompt lengths,
prefilled eagerly once per seed, with seeded noise in every KV slot no request holds -- and
every run starts from that world's snapshot (pool, row table) and rolls its own allocations
back (checked: the allocator must be exactly where it was). So the eager and the graph run of
one case see the same slots, rows and bytes, while the graph runner (static buffers, captured
or compiled keys) persists across runs: that is what makes history dependence observable.

A case with a context length stretches the case's last request for the run (so the longest
request is not the batch's first): its committed prefix grows to that length over slots that
hold the world's seeded noise (a prefill over thousands of positions would cost seconds per
case; eager and graph read the same bytes either way), and shrinks back with the run's own
allocations.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from refengine.config import SamplingParams
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.runner import GraphRunner
from refengine.graph.staging import DUMMY_ROW
from refengine.graph.step_graph import StepGraph
from refengine.memory.allocator import AllocatorState
from refengine.model.llama import ForwardBatch, ForwardOutput
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.core import SpeculativeWorker

# How a poisoned run fills the tail of every static buffer before staging: out-of-range
# integers ("huge", "negative"), or what an earlier, bigger batch would have left there: a
# live request's row, slots and length ("stale"). Floats get NaN, masks all-visible, always.
# ``True`` cycles the three styles over the padded rows (one run covers all of them).
PoisonStyle = Literal["huge", "negative", "stale"]
POISON_STYLES: tuple[PoisonStyle, ...] = ("huge", "negative", "stale")

# Absolute, on logits, features and K/V. Replay runs the model's own code, but its attention
# spans the key width's columns rather than the real lengths, so softmax sums differ in their
# last bits.
REPLAY_TOLERANCE = 1e-4


@dataclass
class World:
    """``max_batch`` prefilled requests (rows assigned in order) and the snapshot every run of
    this seed starts from."""

    seed: int
    reqs: list[Req]
    pools: list[torch.Tensor]
    table: torch.Tensor
    host_table: list[array[int]]  # the row table's host copy, restored with it
    allocator: AllocatorState
    rows_free: int

    @cached_property
    def pools_digest(self) -> str:
        """The digest of the snapshot's pools (taken once, at a world's first run digest;
        the probe's baseline never needs it)."""
        return digest(*self.pools)

    def pools_digest_of(self, pools: list[torch.Tensor], skip: torch.Tensor) -> str:
        """The digest of ``pools`` (the live pools of a run on this world) outside the
        ``skip`` slots: this world's pool digest plus which slots differ from its snapshot,
        bit for bit, and their bytes. Two runs on one world get equal digests exactly when
        their pools are equal outside ``skip``; finding the differences is a comparison, a
        fraction of hashing every byte of every pool before and after each run."""
        keep = torch.ones(pools[0].shape[1], dtype=torch.bool, device=pools[0].device)
        keep[skip] = False
        parts: list[torch.Tensor | str] = [self.pools_digest]
        for pool, saved in zip(pools, self.pools, strict=True):
            differs = (bits(pool) != bits(saved)).flatten(2).any(-1).any(0) & keep
            where = differs.nonzero().flatten()
            parts += [where, pool[:, where]]
        return digest(*parts)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its width: compared bit for bit, NaN equals itself and
    -0.0 differs from 0.0."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def prompt(seed: int, i: int, vocab: int) -> list[int]:
    """Request ``i``'s prompt: 3 .. 52 tokens (different lengths, so rows and widths differ)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return torch.randint(1, vocab, (3 + (7 * i + 5 * seed) % 50,), generator=gen).tolist()


def digest(*parts: torch.Tensor | bytes | str) -> str:
    """SHA-256 over the parts (a tensor's dtype and shape too): equal digests, equal bytes."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(str((part.dtype, tuple(part.shape))).encode())
            # Its bytes in place (no copy), whatever the dtype (numpy has no bfloat16).
            h.update(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()


class ProbeWorld:
    """The engine state a probe runs its cases on: one ``ModelRunner`` (its target and KV
    manager), the graph runners that replay its kinds (``graphs``: staging kind -> runner;
    ``make_graph`` builds one for a staging kind none of them has), and per seed a *world* of
    prefilled requests with a snapshot every run starts from and rolls back to."""

    def __init__(self, runner: ModelRunner, graphs: Mapping[str, GraphRunner] | None = None,
                 make_graph: Callable[[], GraphRunner] | None = None,
                 tolerance: float = REPLAY_TOLERANCE, worker: SpeculativeWorker | None = None
                 ) -> None:
        self.runner = runner
        self.worker = worker  # a speculative engine's worker: its draft loop is a kind too
        self.kv = runner.kv
        self.graphs = dict(graphs or {})
        self._make_graph = make_graph
        self._own: GraphRunner | None = None
        self.tolerance = tolerance
        cfg = runner.target.config
        self.vocab_size = cfg.vocab_size
        self.max_position = int(runner.target.rotary.cos.shape[0])  # rotary table rows
        self.context_limit = cfg.max_position_embeddings
        kv = self.kv
        if kv.rows.free_rows != kv.rows.usable_rows or \
                kv.allocator.free_page_count != kv.allocator.num_pages - 1:
            raise RuntimeError("graph probe: the engine must be idle (no request holds a row "
                               "or KV) when the probe is made")
        self._baseline = self._snapshot(-1, [])
        self._world: World | None = None

    def max_batch(self) -> int:
        return self.buckets()[-1]

    def buckets(self) -> tuple[int, ...]:
        return tuple(self.graph("decode").sizes)

    # --- graph runners ------------------------------------------------------------------------

    def graph(self, staging: str) -> GraphRunner:
        """The graph runner that replays ``staging`` ("decode", "verify")."""
        if staging in self.graphs:
            return self.graphs[staging]
        if self._own is None:
            if self._make_graph is None:
                raise ValueError(f"graph probe: no graph runner for {staging!r}")
            self._own = self._make_graph()
        if staging not in self._own.kinds:
            raise ValueError(f"graph probe: the graph runner has no {staging!r} kind")
        return self._own

    def draft_loop(self) -> DraftLoopGraph | None:
        """The draft loop of the graph runner that replays decode (None without a draft)."""
        return self.graph("decode").draft_loop if self.worker is not None else None

    def draft_extend(self) -> DraftLoopGraph | None:
        """The EAGLE extend graph of the graph runner that replays verify (None without)."""
        if self.worker is None or "verify" not in self.graph("decode").kinds:
            return None
        return self.graph("verify").draft_extend

    def spec_step(self) -> StepGraph | None:
        """The one-graph EAGLE chain step of the graph runner that replays verify (None
        without)."""
        if self.worker is None or "verify" not in self.graph("decode").kinds:
            return None
        return self.graph("verify").spec_step

    @property
    def verify_tokens(self) -> int:
        return self.graph("verify").kinds["verify"]

    # --- worlds and runs ----------------------------------------------------------------------

    @contextmanager
    def requests(self, raw: int, seed: int = 0, committed: int | None = None
                 ) -> Iterator[list[Req]]:
        """The first ``raw`` requests of ``seed``'s world, on a fresh copy of it (pool, row
        table); ``committed``: the last of them stretched to that many committed positions
        (at least every one's prompt: it is then the longest).
        Afterwards what they allocated is rolled back (checked) and the copy restored. Every
        batch built on them must allocate in request order (as the runner's ``prepare_*`` do),
        so rolling back in reverse order restores the free list exactly."""
        if not 1 <= raw <= self.max_batch():
            raise ValueError(f"raw: 1..{self.max_batch()}, got {raw}")
        world = self.world(seed)
        self._restore(world)
        reqs = world.reqs[:raw]
        last, prefilled = reqs[-1], reqs[-1].kv_committed_len
        try:
            if committed is not None:
                longest = max(r.kv_committed_len for r in reqs)
                if committed < longest:
                    raise ValueError(f"committed: at least the longest prompt's {longest} "
                                     f"positions, got {committed}")
                self.kv.extend(last, committed - prefilled)  # slots with the world's noise
                self.kv.commit(last, committed - prefilled)
            yield reqs
        finally:
            for r in reversed(reqs):
                self.kv.truncate(r, r.kv_committed_len)
            self.kv.truncate(last, prefilled)
            self._check_rolled_back(world)
            self._restore(world)

    def release(self) -> None:
        """Give the world's rows and KV back: the engine is as idle as the probe found it
        (pool and row table restored too)."""
        if self._world is not None:
            for r in reversed(self._world.reqs):
                self.kv.release(r)
            self._world = None
            self._check_rolled_back(self._baseline)
        self._restore(self._baseline)

    def world(self, seed: int) -> World:
        """The world of ``seed``, prefilled (the previous one released) when it changes."""
        if self._world is not None and self._world.seed == seed:
            return self._world
        self.release()
        reqs = []
        for i in range(self.max_batch()):
            req = Req(f"graph-probe-{seed}-{i}", prompt(seed, i, self.vocab_size),
                      SamplingParams(), seed, i)
            if not self.kv.assign_row(req):
                raise RuntimeError(f"graph probe: no request row for request {i} "
                                   f"({self.kv.rows.usable_rows} rows)")
            reqs.append(req)
        lens = [len(r.prompt_ids) for r in reqs]
        ids = [t for r in reqs for t in r.prompt_ids]
        ends = [sum(lens[:i + 1]) - 1 for i in range(len(lens))]
        for r, n in zip(reqs, lens, strict=True):
            self.kv.extend(r, n)
        self.runner.forward(self.runner.prepare_extend(reqs, lens, ids, ends))
        for r, n in zip(reqs, lens, strict=True):
            self.kv.commit(r, n)
        self._scribble(reqs, seed)
        self._world = self._snapshot(seed, reqs)
        return self._world

    def _snapshot(self, seed: int, reqs: list[Req]) -> World:
        """The engine's state now, as the world of ``seed`` whose requests are ``reqs``."""
        return World(seed, reqs, [p.clone() for p in self._pools()], self.kv.rows.table.clone(),
                     [row[:] for row in self.kv.rows.host], self.kv.allocator.backup_state(),
                     self.kv.rows.free_rows)

    @property
    def device(self) -> torch.device:
        """Where the engine's tensors live (the row table's device)."""
        return self.kv.rows.table.device

    def _pools(self) -> list[torch.Tensor]:
        pools = [self.kv.target_pool.k, self.kv.target_pool.v]
        if self.kv.draft_pool is not None:
            pools += [self.kv.draft_pool.k, self.kv.draft_pool.v]
        return pools

    def _scribble(self, reqs: list[Req], seed: int) -> None:
        """Seeded noise in every slot no request holds, outside the dummy page: a stray write
        there then changes bytes whatever it writes. Finite, because real rows' masked key
        columns may point at such slots and a masked key still multiplies its value by 0."""
        held = torch.zeros(self.kv.target_pool.k.shape[1], dtype=torch.bool,
                           device=self.kv.rows.table.device)
        held[:self.kv.page_size] = True
        for r in reqs:
            held[self.kv.rows.table[r.row, :r.kv_allocated_len]] = True
        gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same noise anywhere
        for pool in self._pools():
            shape = (pool.shape[0], int((~held).sum()), *pool.shape[2:])
            pool[:, ~held] = torch.randn(shape, generator=gen).to(pool.device, pool.dtype)

    def _restore(self, world: World) -> None:
        for pool, saved in zip(self._pools(), world.pools, strict=True):
            pool.copy_(saved)
        self.kv.rows.table.copy_(world.table)
        for row, saved_row in zip(self.kv.rows.host, world.host_table, strict=True):
            row[:] = saved_row  # the host copy stays equal to the table (``ReqToTokenPool``)

    def _check_rolled_back(self, world: World) -> None:
        if (self.kv.allocator.backup_state() != world.allocator
                or self.kv.rows.free_rows != world.rows_free):
            raise RuntimeError("graph probe: a run's allocations did not roll back exactly "
                               "(the next run would see other slots)")

    # --- what a run reports -------------------------------------------------------------------

    def collect(self, out: ForwardOutput, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """The real rows' outputs: logits and features as the forward returned them (so a
        later run overwriting them would show), the greedy tokens, the K/V they wrote."""
        slots = batch.out_slots
        return {"logits": out.logits, "features": out.features,
                "next_tokens": out.logits.argmax(-1),
                "kv_k": self.kv.target_pool.k[:, slots].clone(),
                "kv_v": self.kv.target_pool.v[:, slots].clone()}

    def pointers(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Every static buffer a replay reads: the staged inputs, the pools, the row table."""
        ptrs = {f"staging.{name}": buf.data_ptr() for name, buf in buffers.items()}
        ptrs.update({f"kv_pool.{i}": p.data_ptr() for i, p in enumerate(self._pools())})
        ptrs["row_table"] = self.kv.rows.table.data_ptr()
        return ptrs

    def poison(self, buffers: Mapping[str, torch.Tensor], raw: int,
               style: bool | PoisonStyle = True) -> None:
        """Hostile values in rows ``raw:`` of every buffer (what staging must overwrite up to
        the bucket, and what no replay may read past it)."""
        world = self._world
        assert world is not None
        live = world.reqs[-1]  # not in the batch unless it fills the largest bucket
        stale = {"input_ids": 5, "positions": 40, "rows": live.row or DUMMY_ROW,
                 "out_slots": int(self.kv.rows.table[live.row, 1]),
                 "seq_lens": live.kv_committed_len}
        for name, buf in buffers.items():
            for j in range(buf.shape[0] - raw):
                chosen = POISON_STYLES[j % 3] if style is True else style
                buf[raw + j] = _hostile(buf, name, chosen, stale)


def _hostile(buf: torch.Tensor, name: str, style: PoisonStyle, stale: dict[str, int]
             ) -> float | int | bool:
    if buf.dtype.is_floating_point:
        return float("nan")
    if buf.dtype == torch.bool:
        return True
    if style == "stale":
        return stale.get(name, 1)
    info = torch.iinfo(buf.dtype)
    return info.max // 2 if style == "huge" else info.min // 2
