"""Drafter: what a speculative algorithm's draft side must provide to the verify core.

A drafter proposes the tokens a decode step verifies and keeps per-request state between steps
(a ``RowState``: EAGLE's ``DraftInput``, Frozen-KV MTP's ``SeedInput``, a standalone draft
model's ``CatchUpInput``, n-gram lookup's ``NgramInput``); the core (``SpeculativeWorker``) owns
that state's rows, the verify forward, the accept rule and the overlap mode. A drafter runs
forwards only through the ``Runner`` and writes KV only into the reserved slots a
``DraftStep`` hands it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.speculative.draft_search import LoopOutput
from refengine.speculative.inputs import DraftExtendInput

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph

State = TypeVar("State")


@dataclass(frozen=True)
class DraftStep:
    """One decode step's requests as a drafter sees them: each request's root position (the
    newest emitted token, whose KV the verify writes), ``slot_lists(tokens)``, each request's
    reserved slots for ``tokens`` positions from its root on (host lists), and the engine's
    device."""

    reqs: list[Req]
    roots: list[int]
    slot_lists: Callable[[int], list[list[int]]]
    device: torch.device

    @property
    def rows(self) -> torch.Tensor:
        return from_host([r.row for r in self.reqs], self.device)

    @property
    def root_positions(self) -> torch.Tensor:
        """``roots`` on the device."""
        return from_host(self.roots, self.device)

    def slots(self, tokens: int) -> torch.Tensor:
        """``[len(reqs), tokens]``: ``slot_lists(tokens)`` on the device."""
        return from_host(self.slot_lists(tokens), self.device).reshape(len(self.reqs), tokens)

    def rows_roots_slots(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``rows``, ``root_positions`` and ``slots(tokens)`` in one copy to the device: what
        a graphed draft step stages (three copies, each a transfer on a GPU, otherwise)."""
        packed = from_host([[r.row, root, *slots] for r, root, slots in
                            zip(self.reqs, self.roots, self.slot_lists(tokens), strict=True)],
                           self.device).reshape(len(self.reqs), tokens + 2)
        return packed[:, 0], packed[:, 1], packed[:, 2:]


class ExtendForward(Protocol):
    """A draft-extend forward of its own, eager and replayed on a graph (EAGLE's head over
    the accepted positions): what the graph probe compares."""

    def eager_extend(self, step: DraftStep, accepted: DraftExtendInput
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the accepted positions -> (logits, predicted features) at each
        request's last one."""

    def graph_extend(self, step: DraftStep, accepted: DraftExtendInput, graph: DraftLoopGraph
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``eager_extend`` replayed by ``graph``; None when it does not take the batch."""


class Drafter(Protocol[State]):
    @property
    def scratch_positions(self) -> int:
        """Draft KV positions past the root a step writes besides the verify block."""

    @property
    def extend_forward(self) -> ExtendForward | None:
        """The drafter's draft-extend forward, where its ``extend`` runs one (None: it
        extends without a forward of its own)."""

    def idle(self) -> State:
        """A state with zero rows (what a batch with no decoding request holds)."""

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> State:
        """After a target prefill (before its KV is committed): the rows of the requests whose
        fill completed (``sampled``: their token just sampled), in batch order."""

    def root_tokens(self, state: State) -> torch.Tensor:
        """Each row's root token (the verify tree's node 0)."""

    def graph_search(self, step: DraftStep, state: State, loop: DraftLoopGraph
                     ) -> LoopOutput | None:
        """The step's draft replayed by ``loop``; None when it does not take the batch."""

    def eager_search(self, step: DraftStep, state: State) -> LoopOutput:
        """The step's draft, forward by forward: a chain's tokens or a beam's candidates."""

    def extend(self, step: DraftStep, state: State, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> State:
        """After verify: the next state of ``step``'s requests from ``state`` (their rows the
        step drafted from) and their accepted runs (``graph``: an extend graph to replay, where
        the drafter has one)."""
