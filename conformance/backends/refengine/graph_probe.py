"""The graph probe: the reference engine's side of the graph tier
(``conformance/contract/graph_probe.py`` states the protocol; docs/adapter.md describes it).

A probe runs one synthetic forward -- a *case*: a kind ("decode", "verify-chain",
"verify-tree"), a raw batch size and a seed -- either eagerly (the plain ``ModelRunner``, no
padding) or through a ``GraphRunner`` (stage, pad to the bucket, execute, slice), and reports
what a suite needs to compare the two from outside: the real rows' outputs, digests of every
piece of engine state the real rows do not own, the addresses of the static buffers, and what
staging left in the padded rows. The properties themselves (graph == eager, poisoned padding
changes nothing, no history dependence, ...) are checked by the suite, not here. The probe
also lists each kind's key widths (``KeyWidthProbe``) and runs a case at a given context
length, reporting the width its graph run replayed on.

Why runs are comparable: ``graph_world.py`` (every run starts from its seed's world and rolls
back to it). The kinds are the table in ``graph_kinds.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from conformance.backends.refengine.graph_kinds import (
    KINDS,
    DraftExtendKind,
    DraftLoopKind,
    OneGraphStepKind,
    Prepared,
    ProbeKind,
)
from conformance.backends.refengine.graph_world import (
    REPLAY_TOLERANCE,
    PoisonStyle,
    ProbeWorld,
    digest,
)
from conformance.contract import GraphCase, GraphRun, Mode, PaddingPolicy
from refengine.graph.runner import GraphRunner
from refengine.graph.staging import DUMMY_ROW, DUMMY_SLOT
from refengine.request import Req
from refengine.speculative.core import SpeculativeWorker

if TYPE_CHECKING:
    from refengine.engine import Engine

DEFAULT_VERIFY_TOKENS = 4   # verify kinds' tokens per request when the engine has no spec
COMPILED_TOLERANCE = 1e-4   # as REPLAY_TOLERANCE: inductor also reorders reductions


class RefGraphProbe(ProbeWorld):
    """The graph probe protocol (``GraphProbe``) over a ``ProbeWorld``: the kinds of
    ``KINDS`` the engine has, each case run from its world's snapshot."""

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

    def key_widths(self, kind: str) -> tuple[int, ...]:
        return tuple(self._kind(kind).key_widths(self))

    def max_context(self, kind: str) -> int:
        """The widest key width, and a committed prefix the model can reach (one short of its
        context limit) whose allocation past it fits the row table."""
        k = self._kind(kind)
        past = k.past_committed(self)
        committed = min(self.context_limit - 1, self.kv.rows.max_context_len - k.reach(self))
        return min(self.key_widths(kind)[-1], committed + past)

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
                             for name, buf in prep.buffers.items() if name in prep.padded_names},
                            prep.key_width if mode == "graph" else None)

    def _kind(self, kind: str) -> ProbeKind:
        if kind not in self.kinds():
            raise ValueError(f"unknown graph kind {kind!r} (known: {', '.join(self.kinds())})")
        return KINDS[kind]

    @contextmanager
    def prepared(self, case: GraphCase, mode: Mode) -> Iterator[Prepared]:
        """``case`` built in ``mode`` on a fresh copy of its world, not yet executed (a
        ``context``: the last request's committed prefix is that less the kind's columns
        past it)."""
        kind = self._kind(case.kind)
        committed = None
        if case.context is not None:
            top = self.max_context(case.kind)
            if not case.context <= top:
                raise ValueError(f"context: at most {top} for {case.kind!r}, got {case.context}")
            committed = case.context - kind.past_committed(self)
        with self.requests(case.raw, case.seed, committed) as reqs, self._drafting(kind, reqs):
            yield kind.prepare(self, reqs, case.seed, mode)

    def _drafting(self, kind: ProbeKind, reqs: list[Req]) -> AbstractContextManager[None]:
        """A draft kind's requests as the worker drafts them (a V2 worker: reserved and
        rooted); left before ``requests`` rolls their allocations back."""
        if (isinstance(kind, (DraftLoopKind, DraftExtendKind, OneGraphStepKind))
                and self.worker is not None):
            stack = ExitStack()
            stack.enter_context(self.worker.drafting_from_committed_end(reqs))
            stack.enter_context(self.kv.reserved(reqs, self.worker.reservation))
            return stack
        return nullcontext()

    def digests(self, targets: torch.Tensor, kind: str) -> dict[str, str]:
        """"kv": every KV pool outside ``targets`` and the dummy page; "request_rows": the row
        table; "allocator": the free page list and the free row count."""
        skip = torch.arange(self.kv.page_size, device=self.kv.rows.table.device)
        if self.writes_kv(kind):
            skip = torch.cat([skip, targets.reshape(-1)])
        alloc = self.kv.allocator.backup_state()
        assert self._world is not None, "digests: only of a run on a world"
        return {"kv": self._world.pools_digest_of(self._pools(), skip),
                "request_rows": digest(self.kv.rows.table),
                "allocator": digest(repr(alloc.free_pages), alloc.is_free,
                                    str(self.kv.rows.free_rows))}
