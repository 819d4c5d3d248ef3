"""The graph probe: the reference engine's side of the graph tier (``conformance/graph_probe.py``
states the protocol; docs/adapter.md describes it).

A probe runs one synthetic forward -- a *case*: a kind ("decode", "verify-chain",
"verify-tree"), a raw batch size and a seed -- either eagerly (the plain ``ModelRunner``, no
padding) or through a ``GraphRunner`` (stage, pad to the bucket, execute, slice), and reports
what a suite needs to compare the two from outside: the real rows' outputs, digests of every
piece of engine state the real rows do not own, the addresses of the static buffers, and what
staging left in the padded rows. The properties themselves (graph == eager, poisoned padding
changes nothing, no history dependence, ...) are checked by the suite, not here.

Why runs are comparable: every case runs on a *world* -- ``max_batch`` requests with
different prompt lengths, prefilled eagerly once per seed, with seeded noise in every KV slot
no request holds -- and every run starts from that world's snapshot (pool, row table) and
rolls its own allocations back (checked: the allocator must be exactly where it was). So the
eager and the graph run of one case see the same slots, rows and bytes, while the graph
runner (static buffers, captured or compiled keys) persists across runs: that is what makes
history dependence observable.

Kinds are a table (``KINDS``): a kind says how to build and run its case in either mode and
which of its staged buffers are index fields. A kind that is one target forward is a
``ForwardKind`` (a batch builder and the graph runner's staging kind); the draft loops add
kinds of their own the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from conformance.graph_probe import GraphCase, GraphRun, Mode, PaddingPolicy
from refengine.config import SamplingParams
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import DUMMY_ROW, DUMMY_SLOT, PAD_POLICY
from refengine.memory.allocator import AllocatorState
from refengine.model.llama import ForwardBatch, ForwardOutput
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.draft_search import Candidates, LoopOutput
from refengine.speculative.inputs import DraftExtendInput, DraftInput, SeedInput, VerifyInput

if TYPE_CHECKING:
    from refengine.engine import Engine

# How a poisoned run fills the tail of every static buffer before staging: out-of-range
# integers ("huge", "negative"), or what an earlier, bigger batch would have left there: a
# live request's row, slots and length ("stale"). Floats get NaN, masks all-visible, always.
# ``True`` cycles the three styles over the padded rows (one run covers all of them).
PoisonStyle = Literal["huge", "negative", "stale"]
POISON_STYLES: tuple[PoisonStyle, ...] = ("huge", "negative", "stale")

# The names the probe protocol gives the index fields of the padded rows, by the name of the
# staged buffer that holds them (``Staging.buffers``).
PADDED_FIELDS: dict[str, str] = {"rows": "request_rows", "out_slots": "out_slots",
                                 "input_ids": "token_ids", "positions": "positions",
                                 "seq_lens": "lengths"}

DEFAULT_VERIFY_TOKENS = 4   # verify kinds' tokens per request when the engine has no spec
# Absolute, on logits, features and K/V. Replay runs the model's own code, but its attention
# spans the key width's columns rather than the real lengths, so softmax sums differ in their
# last bits (tiny-code: up to 1.1e-5 on logits); inductor also reorders reductions.
REPLAY_TOLERANCE = 1e-4
COMPILED_TOLERANCE = 1e-4


# --- kinds ------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """A case ready to run in one mode: its allocations made, nothing executed yet."""

    execute: Callable[[], dict[str, torch.Tensor]]   # runs it -> the real rows' outputs
    targets: torch.Tensor                            # KV slots the real rows write
    bucket: int
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # static buffers (graph)
    padded_names: Mapping[str, str] = field(default_factory=dict)   # buffer -> protocol name
    batch: ForwardBatch | None = None   # a one-forward kind's batch (for white-box tests)


class ProbeKind(Protocol):
    """One entry of ``KINDS``: adding a kind (a draft loop) is one class like ``ForwardKind``
    and one line in the table."""

    @property
    def writes_kv(self) -> bool:
        """Whether the kind's real rows write KV (their target slots are then left out of
        the "kv" digest)."""

    def available(self, probe: RefGraphProbe) -> bool:
        """Whether the probe's engine has what the kind runs (a draft loop of its kind)."""

    def length_fill(self, probe: RefGraphProbe) -> int:
        """The length a padded row's length field must hold."""

    def prepare(self, probe: RefGraphProbe, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        """Build the case for ``reqs`` in ``mode``: the eager path unpadded, the graph path on
        the graph runner (raising if it would not replay)."""


Batcher = ModelRunner | GraphRunner  # both build batches (the graph runner only adds tags)
BatchBuilder = Callable[["RefGraphProbe", Batcher, list[Req], int], ForwardBatch]


def decode_batch(probe: RefGraphProbe, runner: Batcher, reqs: list[Req], seed: int
                 ) -> ForwardBatch:
    """One new token per request at its committed end."""
    vocab = probe.vocab_size
    ids = [(7 * r.kv_committed_len + 11 + 13 * seed) % (vocab - 1) + 1 for r in reqs]
    for r in reqs:
        probe.kv.extend(r, 1)  # what the scheduler allocates for a decode step
    return runner.prepare_extend(reqs, [1] * len(reqs), ids, list(range(len(reqs))))


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n]: node i sees itself and its ancestors (``parents[i]``, -1 for the root)."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def verify_batch(probe: RefGraphProbe, runner: Batcher, reqs: list[Req], seed: int,
                 causal: bool) -> ForwardBatch:
    """``N`` draft nodes per request after its committed end: a chain (causal) or a binary
    tree (node i's parent is (i - 1) // 2: two branches from the root already at N = 3)."""
    b, n, vocab = len(reqs), probe.verify_tokens, probe.vocab_size
    flat = torch.arange(b * n, dtype=torch.int64).view(b, n)
    tokens = (flat * 37 + 101 * seed) % (vocab - 1) + 1
    start = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
    parents = [i - 1 for i in range(n)] if causal else [(i - 1) // 2 if i else -1
                                                         for i in range(n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    minus = torch.full((b, n), -1, dtype=torch.int64)
    vin = VerifyInput(tokens, tree_mask(parents).expand(b, n, n).clone(),
                      start[:, None] + torch.tensor(depth), minus, minus, minus, minus)
    slots = torch.stack([probe.kv.extend(r, n) for r in reqs]) if reqs else \
        torch.empty((0, n), dtype=torch.int64)
    return runner.prepare_verify(reqs, vin, slots, causal)


@dataclass(frozen=True)
class ForwardKind:
    """A kind that is one target forward, replayed on the graph runner's ``staging`` kind."""

    staging: str
    build: BatchBuilder
    writes_kv: bool = True

    def available(self, probe: RefGraphProbe) -> bool:
        return True

    def length_fill(self, probe: RefGraphProbe) -> int:
        q = probe.graph(self.staging).kinds[self.staging]
        fill = PAD_POLICY["seq_lens"].fill(q)
        assert isinstance(fill, int)
        return fill

    def prepare(self, probe: RefGraphProbe, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        if mode == "eager":
            batch = self.build(probe, probe.runner, reqs, seed)
            return Prepared(lambda: probe.collect(probe.runner.forward(batch), batch),
                            batch.out_slots, len(reqs), batch=batch)
        graph = probe.graph(self.staging)
        batch = self.build(probe, graph, reqs, seed)
        key = graph.graph_key(batch)
        if key is None or key.kind != self.staging:
            raise RuntimeError(f"graph probe: {len(reqs)} requests do not replay on the "
                               f"{self.staging!r} graph (key {key}); a graph run that fell "
                               "back to eager would prove nothing")
        assert isinstance(batch, GraphBatch)
        return Prepared(lambda: probe.collect(graph.forward(batch), batch), batch.out_slots,
                        key.bucket, graph.staging[key.kind].buffers, PADDED_FIELDS, batch)


@dataclass(frozen=True)
class DraftLoopKind:
    """A whole draft step of the engine's worker: eager = the worker's own forward-by-forward
    search (Frozen-KV MTP: the seed step, then the loop); graph = the ``DraftLoopGraph``
    (MTP's seed folded in). Inputs are seeded: the step's candidates and features for EAGLE,
    the bonus tokens and target features for MTP. EAGLE writes its head's KV into scratch
    slots (the targets); MTP writes none, anywhere."""

    loop_kind: str                      # "draft:eagle" or "draft:mtp"
    writes_kv: bool
    length_fill_value: int
    padded_names: Mapping[str, str]     # staged buffer -> protocol name

    def available(self, probe: RefGraphProbe) -> bool:
        loop = probe.draft_loop()
        return loop is not None and loop.kind == self.loop_kind

    def length_fill(self, probe: RefGraphProbe) -> int:
        return self.length_fill_value

    def inputs(self, probe: RefGraphProbe, reqs: list[Req], seed: int
               ) -> DraftInput | SeedInput:
        loop = probe.draft_loop()
        assert loop is not None and probe.worker is not None
        b, k, vocab = len(reqs), loop.topk, probe.vocab_size
        gen = torch.Generator().manual_seed(10_007 * seed + 17)
        hidden = torch.randn((b, loop.staging.buffers["hidden"].shape[1]), generator=gen)
        hidden = hidden.to(loop.staging.buffers["hidden"].dtype)
        tokens = torch.randint(1, vocab, (b,), generator=gen)
        if self.loop_kind == "draft:mtp":
            return SeedInput(tokens, hidden)
        scores = torch.rand((b, k), generator=gen).sort(dim=1, descending=True).values
        return DraftInput(scores, torch.randint(1, vocab, (b, k), generator=gen), hidden,
                          tokens)

    def prepare(self, probe: RefGraphProbe, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        worker, loop = probe.worker, probe.draft_loop()
        assert worker is not None and loop is not None
        din = self.inputs(probe, reqs, seed)
        targets = torch.empty((0,), dtype=torch.int64)
        if self.writes_kv:  # the scratch slots drafting will take (handed back right away)
            slots = worker.scratch_slots(reqs, loop.topk * (loop.steps - 1))
            targets = slots.reshape(-1).clone()
        if mode == "eager":
            return Prepared(lambda: loop_outputs(worker.eager_search(reqs, din)), targets,
                            len(reqs))
        key = loop.key(len(reqs), torch.tensor([r.kv_committed_len for r in reqs]))
        if key is None:
            raise RuntimeError(f"graph probe: {len(reqs)} requests do not replay on the "
                               f"{self.loop_kind!r} loop; a graph run that fell back to "
                               "eager would prove nothing")

        def execute() -> dict[str, torch.Tensor]:
            found = worker.graph_search(reqs, din, loop)  # type: ignore[arg-type]
            assert found is not None
            return loop_outputs(found)

        return Prepared(execute, targets, key[0], loop.staging.buffers, self.padded_names)


@dataclass(frozen=True)
class DraftExtendKind:
    """EAGLE's draft-extend: eager = the worker's head forward over each request's accepted
    tokens; graph = the extend graph (``DraftLoopGraph`` of kind "extend:eagle"). Inputs are
    seeded: 1..N accepted tokens per request ending at its committed end (the root), with
    random features. The head writes its KV at those positions' slots (the targets)."""

    writes_kv = True
    padded_names: Mapping[str, str]     # staged buffer -> protocol name

    def available(self, probe: RefGraphProbe) -> bool:
        return probe.draft_extend() is not None

    def length_fill(self, probe: RefGraphProbe) -> int:
        return 1

    def prepare(self, probe: RefGraphProbe, reqs: list[Req], seed: int, mode: Mode
                ) -> Prepared:
        worker, graph = probe.worker, probe.draft_extend()
        assert worker is not None and graph is not None
        n, hidden_size = graph.staging.buffers["hidden"].shape[1:]
        gen = torch.Generator().manual_seed(10_007 * seed + 29)
        ends = torch.tensor(worker.roots(reqs), dtype=torch.int64)
        lens = torch.minimum(torch.randint(1, n + 1, (len(reqs),), generator=gen), ends)
        total = int(lens.sum())
        ids = torch.randint(1, probe.vocab_size, (total,), generator=gen)
        hidden = torch.randn((total, hidden_size), generator=gen).to(
            graph.staging.buffers["hidden"].dtype)
        targets = torch.cat([probe.kv.rows.table[r.row, e - a:e] for r, e, a
                             in zip(reqs, ends.tolist(), lens.tolist(), strict=True)])
        ext = DraftExtendInput(hidden, ids, lens)
        if mode == "eager":
            return Prepared(lambda: extend_outputs(worker.eager_extend(reqs, ext)), targets,
                            len(reqs))
        key = graph.key(len(reqs), ends)
        if key is None:
            raise RuntimeError(f"graph probe: {len(reqs)} requests do not replay on the "
                               "'extend:eagle' graph; a graph run that fell back to eager "
                               "would prove nothing")

        def execute() -> dict[str, torch.Tensor]:
            found = worker.graph_extend(reqs, ext, graph)
            assert found is not None
            return extend_outputs(found)

        return Prepared(execute, targets, key[0], graph.staging.buffers, self.padded_names)


def extend_outputs(found: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A draft-extend's result: the head's logits, greedy tokens and predicted features at
    each request's newest accepted token."""
    logits, predicted = found
    return {"logits": logits, "next_tokens": logits.argmax(-1), "features": predicted}


def loop_outputs(found: LoopOutput) -> dict[str, torch.Tensor]:
    """A draft step's result: a chain's tokens, or a beam's candidates."""
    if isinstance(found, Candidates):
        return {"scores": found.scores, "tokens": found.tokens, "parents": found.parents}
    return {"draft_tokens": found}


KINDS: dict[str, ProbeKind] = {
    "decode": ForwardKind("decode", decode_batch),
    "verify-chain": ForwardKind(
        "verify", lambda p, r, reqs, s: verify_batch(p, r, reqs, s, causal=True)),
    "verify-tree": ForwardKind(
        "verify", lambda p, r, reqs, s: verify_batch(p, r, reqs, s, causal=False)),
    "draft:eagle": DraftLoopKind("draft:eagle", True, 0, {
        "rows": "request_rows", "scratch": "out_slots", "topk_index": "token_ids",
        "roots": "lengths"}),
    "draft:mtp": DraftLoopKind("draft:mtp", False, 1, {
        "rows": "request_rows", "bonus_tokens": "token_ids", "seq_lens": "lengths"}),
    "extend:eagle": DraftExtendKind({
        "rows": "request_rows", "slots": "out_slots", "ids": "token_ids", "ends": "lengths"}),
}


# --- worlds: the prefilled requests every case of a seed runs on ------------------------------

@dataclass
class World:
    """``max_batch`` prefilled requests (rows assigned in order) and the snapshot every run of
    this seed starts from."""

    seed: int
    reqs: list[Req]
    pools: list[torch.Tensor]
    table: torch.Tensor
    allocator: AllocatorState
    rows_free: int


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
            h.update(part.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()


class RefGraphProbe:
    """The probe over one ``ModelRunner`` (its target and KV manager) and the graph runners
    that replay its kinds (``graphs``: staging kind -> runner; ``make_graph`` builds one for a
    staging kind none of them has)."""

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
        kv = self.kv
        if kv.rows.free_rows != kv.rows.usable_rows or \
                kv.allocator.free_page_count != kv.allocator.num_pages - 1:
            raise RuntimeError("graph probe: the engine must be idle (no request holds a row "
                               "or KV) when the probe is made")
        self._baseline = World(-1, [], [p.clone() for p in self._pools()],
                               kv.rows.table.clone(), kv.allocator.backup_state(),
                               kv.rows.free_rows)
        self._world: World | None = None

    @classmethod
    def for_engine(cls, engine: Engine) -> RefGraphProbe:
        """The probe of an engine: its ``ModelRunner`` and KV manager; its own graph runner
        for the kinds it has (``EngineConfig(cuda_graph=True)``), else one of the engine's
        graph runner class with the engine's executor ("replay" when graphs are off)."""
        own = engine.runner
        runner = own.runner if isinstance(own, GraphRunner) else own
        config = engine.config
        executor = config.graph_executor if config.cuda_graph else "replay"
        graphs = dict.fromkeys(own.kinds, own) if isinstance(own, GraphRunner) else {}
        spec = config.spec
        verify = (graphs["verify"].kinds["verify"] if "verify" in graphs
                  else DEFAULT_VERIFY_TOKENS if spec is None else spec.num_draft_tokens)

        def make() -> GraphRunner:
            return engine.graph_runner_class(
                runner, executor, max_bs=config.max_running_requests, verify_tokens=verify,
                draft_steps=None if spec is None else (spec.topk, spec.num_steps))

        # The draft kinds run the worker's own search (V1 or, under overlap, V2) on the
        # probe's requests, set up by ``drafting_from_committed_end``.
        worker = engine.worker
        return cls(runner, graphs, make,
                   REPLAY_TOLERANCE if executor == "replay" else COMPILED_TOLERANCE,
                   worker if isinstance(worker, SpeculativeWorker) else None)

    # --- the protocol -------------------------------------------------------------------------

    def kinds(self) -> tuple[str, ...]:
        return tuple(name for name, kind in KINDS.items() if kind.available(self))

    def max_batch(self) -> int:
        return self.buckets()[-1]

    def buckets(self) -> tuple[int, ...]:
        return tuple(self.graph("decode").sizes)

    def padding_policy(self, kind: str) -> PaddingPolicy:
        return PaddingPolicy(DUMMY_ROW, DUMMY_SLOT, self.vocab_size,
                             self._kind(kind).length_fill(self), self.max_position)

    def float_tolerance(self) -> float:
        return self.tolerance

    def writes_kv(self, kind: str) -> bool:
        return self._kind(kind).writes_kv

    def run(self, case: GraphCase, mode: Mode, poison: bool | PoisonStyle = False
            ) -> GraphRun:
        """Run ``case`` from its world's snapshot; ``poison`` (graph mode): fill the tail of
        every static buffer with hostile values first (``PoisonStyle``; True cycles them)."""
        if mode not in ("eager", "graph"):
            raise ValueError(f"mode: 'eager' or 'graph', got {mode!r}")
        if poison and mode != "graph":
            raise ValueError("poison: only a graph run has static buffers to poison")
        with self.prepared(case, mode) as prep:
            initial = self.digests(prep.targets, case.kind)
            if poison:
                self.poison(prep.buffers, case.raw, poison)
            outputs = prep.execute()
            state = self.digests(prep.targets, case.kind)
            return GraphRun(case, mode, prep.bucket, outputs, initial, state,
                            self.pointers(prep.buffers) if mode == "graph" else {},
                            {prep.padded_names[name]: buf[case.raw:prep.bucket].clone()
                             for name, buf in prep.buffers.items() if name in prep.padded_names})

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

    def _kind(self, kind: str) -> ProbeKind:
        if kind not in self.kinds():
            raise ValueError(f"unknown graph kind {kind!r} (known: {', '.join(self.kinds())})")
        return KINDS[kind]

    def draft_loop(self) -> DraftLoopGraph | None:
        """The draft loop of the graph runner that replays decode (None without a draft)."""
        return self.graph("decode").draft_loop if self.worker is not None else None

    def draft_extend(self) -> DraftLoopGraph | None:
        """The EAGLE extend graph of the graph runner that replays verify (None without)."""
        if self.worker is None or "verify" not in self.graph("decode").kinds:
            return None
        return self.graph("verify").draft_extend

    @property
    def verify_tokens(self) -> int:
        return self.graph("verify").kinds["verify"]

    # --- worlds and runs ----------------------------------------------------------------------

    @contextmanager
    def prepared(self, case: GraphCase, mode: Mode) -> Iterator[Prepared]:
        """``case`` built in ``mode`` on a fresh copy of its world, not yet executed."""
        kind = self._kind(case.kind)
        with self.requests(case.raw, case.seed) as reqs, self._drafting(kind, reqs):
            yield kind.prepare(self, reqs, case.seed, mode)

    def _drafting(self, kind: ProbeKind, reqs: list[Req]) -> AbstractContextManager[None]:
        """A draft kind's requests as the worker drafts them (a V2 worker: reserved and
        rooted); left before ``requests`` rolls their allocations back."""
        if isinstance(kind, (DraftLoopKind, DraftExtendKind)) and self.worker is not None:
            stack = ExitStack()
            stack.enter_context(self.worker.drafting_from_committed_end(reqs))
            stack.enter_context(self.kv.reserved(reqs, self.worker.reservation))
            return stack
        return nullcontext()

    @contextmanager
    def requests(self, raw: int, seed: int = 0) -> Iterator[list[Req]]:
        """The first ``raw`` requests of ``seed``'s world, on a fresh copy of it (pool, row
        table); afterwards what they allocated is rolled back (checked) and the copy
        restored. Every batch built on them must allocate in request order (as the runner's
        ``prepare_*`` do), so rolling back in reverse order restores the free list exactly."""
        if not 1 <= raw <= self.max_batch():
            raise ValueError(f"raw: 1..{self.max_batch()}, got {raw}")
        world = self.world(seed)
        self._restore(world)
        reqs = world.reqs[:raw]
        try:
            yield reqs
        finally:
            for r in reversed(reqs):
                self.kv.truncate(r, r.kv_committed_len)
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
        self._world = World(seed, reqs, [p.clone() for p in self._pools()],
                            self.kv.rows.table.clone(), self.kv.allocator.backup_state(),
                            self.kv.rows.free_rows)
        return self._world

    def _pools(self) -> list[torch.Tensor]:
        pools = [self.kv.target_pool.k, self.kv.target_pool.v]
        if self.kv.draft_pool is not None:
            pools += [self.kv.draft_pool.k, self.kv.draft_pool.v]
        return pools

    def _scribble(self, reqs: list[Req], seed: int) -> None:
        """Seeded noise in every slot no request holds, outside the dummy page: a stray write
        there then changes bytes whatever it writes. Finite, because real rows' masked key
        columns may point at such slots and a masked key still multiplies its value by 0."""
        held = torch.zeros(self.kv.target_pool.k.shape[1], dtype=torch.bool)
        held[:self.kv.page_size] = True
        for r in reqs:
            held[self.kv.rows.table[r.row, :r.kv_allocated_len]] = True
        gen = torch.Generator().manual_seed(seed)
        for pool in self._pools():
            shape = (pool.shape[0], int((~held).sum()), *pool.shape[2:])
            pool[:, ~held] = torch.randn(shape, generator=gen).to(pool.dtype)

    def _restore(self, world: World) -> None:
        for pool, saved in zip(self._pools(), world.pools, strict=True):
            pool.copy_(saved)
        self.kv.rows.table.copy_(world.table)

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

    def digests(self, targets: torch.Tensor, kind: str) -> dict[str, str]:
        """"kv": every KV pool outside ``targets`` and the dummy page; "request_rows": the row
        table; "allocator": the free page list and the free row count."""
        keep = torch.ones(self.kv.target_pool.k.shape[1], dtype=torch.bool)
        keep[:self.kv.page_size] = False
        if self.writes_kv(kind):
            keep[targets] = False
        alloc = self.kv.allocator.backup_state()
        return {"kv": digest(*(p[:, keep] for p in self._pools())),
                "request_rows": digest(self.kv.rows.table),
                "allocator": digest(repr(alloc.free_pages), alloc.is_free,
                                    str(self.kv.rows.free_rows))}

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
