"""The reference engine's worker hooks (``contract/worker_hooks.py``): phase traces and forced
verify outcomes.

The hooks wrap the worker's phase methods of one engine instance; the
engine class is untouched, so a mutant engine is traced just the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from conformance.contract.worker_hooks import PhaseRecord
from refengine import Engine
from refengine.request import Req
from refengine.speculative.accept import VerifyOutcome
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.draft_state import RowState
from refengine.speculative.inputs import DraftExtendInput, VerifyInput

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def describe(phase: str, obj: DataclassInstance, rids: tuple[str, ...] = ()) -> PhaseRecord:
    shapes, dtypes = {}, {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            shapes[f.name] = tuple(value.shape)
            dtypes[f.name] = str(value.dtype).replace("torch.", "")
    return PhaseRecord(phase, type(obj).__name__, shapes, dtypes, rids)


def shadow(obj: object, name: str, method: Callable[..., object]) -> None:
    """Replace ``obj``'s method ``name`` on this instance alone (its class stays untouched)."""
    setattr(obj, name, method)


@dataclass
class RefEngineWorkerHooks:
    engine: Engine
    trace: list[PhaseRecord] = field(default_factory=list)
    forced: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        worker = self.engine.worker
        if worker is None:
            raise ValueError("worker hooks need a speculative engine (spec=None given)")
        if not isinstance(worker, SpeculativeWorker):
            raise TypeError(f"worker hooks trace a SpeculativeWorker, not "
                            f"{type(worker).__name__}")
        # The traces and forced outcomes are of the phases one by one: no step as one graph.
        worker.one_graph_steps = False
        state = worker.draft_state
        draft, verify, extend = worker.draft, worker.verify, worker.extend_input
        add, install = state.add, state.install

        def traced_draft(reqs: list[Req], draft_input: RowState) -> VerifyInput:
            verify_input = draft(reqs, draft_input)
            self.trace.append(describe("draft", verify_input, tuple(r.rid for r in reqs)))
            return verify_input

        def traced_verify(reqs: list[Req], verify_input: VerifyInput) -> VerifyOutcome:
            return self._force(reqs, verify(reqs, verify_input))

        def traced_extend(outcome: VerifyOutcome, keep: list[int]) -> DraftExtendInput:
            accepted = extend(outcome, keep)
            self.trace.append(describe("verify", accepted))
            return accepted

        def traced_add(rids: list[str], rows: RowState) -> None:
            self.trace.append(describe("prefill", rows, tuple(rids)))
            add(rids, rows)

        def traced_install(rids: list[str], draft_input: RowState) -> None:
            install(rids, draft_input)
            self.trace.append(describe("install", draft_input, tuple(rids)))

        for obj, name, method in ((worker, "draft", traced_draft),
                                  (worker, "verify", traced_verify),
                                  (worker, "extend_input", traced_extend),
                                  (state, "add", traced_add), (state, "install", traced_install)):
            shadow(obj, name, method)

    def force_accept(self, rid: str, drafts: int) -> None:
        self.forced[rid] = drafts

    def _force(self, reqs: list[Req], outcome: VerifyOutcome) -> VerifyOutcome:
        """Replace a request's path by the tree's first-child chain of the forced length."""
        verify_input = outcome.verify_input
        assert verify_input is not None, "the phases run one by one under the hooks"
        for i, req in enumerate(reqs):
            if req.rid not in self.forced:
                continue
            path = [0]
            while len(path) - 1 < self.forced[req.rid]:
                child = int(verify_input.retrieve_next_token[i, path[-1]])
                if child < 0:
                    break
                path.append(child)
            tokens = [int(verify_input.draft_tokens[i, j]) for j in path[1:]]
            bonus = outcome.emitted[i][-1]
            outcome.nodes[i], outcome.emitted[i] = path, [*tokens, bonus]
        return outcome
