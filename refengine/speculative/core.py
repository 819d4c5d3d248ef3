"""SpeculativeWorker: the one verify/accept/commit core every speculative algorithm runs on.

A decode step: the drafter proposes (``draft``: a chain's tokens or a beam's candidates, made
into the verify tree), the target verifies the tree in one forward writing the verify block's
reserved slots (``verify``), the accept rule (``accept.py``) picks each request's path, resolve
commits it (``OutputProcessor``) and the drafter continues from the accepted runs (``extend``).
What differs between algorithms is the drafter (``drafter.py``: EAGLE, Frozen-KV MTP, a
standalone draft model, n-gram lookup); whether a step is resolved at once or one engine step
late is the mode (``modes.py``: sequential, overlap).

The worker owns the batch's draft state (``DraftState``), which follows the batch through
finish, abort and retraction; when every request finishes inside verify an idle state is
installed, so the next merge works (bug class all-finish-in-verify). It reads request and KV
bookkeeping, runs forwards through the ``Runner`` and writes KV only into the slots the
scheduler reserved (``reservation``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from refengine.clock import PhaseClock
from refengine.config import SpecConfig
from refengine.device import from_host
from refengine.memory.manager import KVManager
from refengine.memory.reservation import DecodeReservation
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import Runner
from refengine.speculative.accept import VerifyOutcome, accept, walked_paths
from refengine.speculative.draft_search import LoopOutput
from refengine.speculative.draft_state import DraftState, RowState
from refengine.speculative.drafter import Drafter, DraftStep, ExtendForward
from refengine.speculative.inputs import DraftExtendInput, DraftInput, SeedInput, VerifyInput
from refengine.speculative.modes import Overlap, Sequential, StepMode
from refengine.speculative.tree import ChainTree, verify_input
from refengine.speculative.verify import SampledPath, verify_tree_sampling
from refengine.step import StepResult

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph
    from refengine.graph.step_graph import StepGraph, StepOutput


class SpeculativeWorker:
    draft_state_class: type[DraftState] = DraftState  # an extension point (the bug zoo)

    def __init__(self, spec: SpecConfig, runner: Runner, kv: KVManager,
                 clock: PhaseClock, drafter: Drafter[Any]) -> None:
        self.spec = spec
        self.runner = runner
        self.kv = kv
        self.clock = clock
        self.drafter = drafter
        self.mode: StepMode = (
            Overlap(spec, kv, runner.target.config.max_position_embeddings) if spec.overlap
            else Sequential())
        self._chain = ChainTree(spec.num_steps + 1)
        self.draft_state = self.draft_state_class(drafter.idle())
        # Whether a greedy step may run as one graph when the runner has one (the worker
        # hooks turn it off: they trace and force the phases one by one).
        self.one_graph_steps = True

    # --- what the scheduler reserves, and where a step's KV goes ------------------------------

    @property
    def reservation(self) -> DecodeReservation:
        """A sequential step writes the verify block or the draft scratch past each root,
        whichever is longer; an overlap step holds the mode's reservation."""
        return self.mode.reservation(self.spec.num_draft_tokens, self.drafter.scratch_positions)

    @property
    def reserve_bound(self) -> int:
        """How far past its committed end a request may hold KV between steps."""
        return self.mode.reserve_bound

    def roots(self, reqs: list[Req]) -> list[int]:
        """Each request's root position (its newest emitted token's)."""
        return self.mode.roots(reqs)

    def reserved_slots(self, reqs: list[Req], tokens: int) -> torch.Tensor:
        """``[len(reqs), tokens]`` reserved slots from each root on."""
        return from_host(self.reserved_slot_lists(reqs, tokens),
                         self.kv.device).reshape(len(reqs), tokens)

    def reserved_slot_lists(self, reqs: list[Req], tokens: int) -> list[list[int]]:
        """``reserved_slots`` on the host."""
        roots = self.roots(reqs)
        short = [r.rid for r, s in zip(reqs, roots, strict=True)
                 if s + tokens > r.kv_allocated_len]
        if short:
            raise RuntimeError(f"requests {short} have no reservation for {tokens} positions "
                               "past their root")
        return self.kv.block_slot_lists(reqs, roots, tokens)

    def draft_step(self, reqs: list[Req]) -> DraftStep:
        return DraftStep(reqs, self.roots(reqs),
                         lambda tokens: self.reserved_slot_lists(reqs, tokens),
                         self.kv.device)

    @contextmanager
    def drafting_from_committed_end(self, reqs: list[Req]) -> Iterator[None]:
        """Lets ``reqs`` (committed, in no step) draft one step from their committed end, as
        if just scheduled for decode: what the graph probe runs a draft kind on. Enter it
        before reserving them (``KVManager.reserved`` with ``reservation``)."""
        with self.mode.rooted_at_committed_end(reqs):
            yield

    # --- the engine's side: prefill, the decode step, resolve, drop ---------------------------

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        """After a target prefill (before its KV is committed): requests whose fill completed
        (``sampled``: the token just sampled for them) get their draft state."""
        done = [r for r in reqs if r.rid in sampled]
        rows = self.drafter.prefill(reqs, lens, batch, features, sampled)
        self.draft_state.add([r.rid for r in done], rows)
        self.mode.started(done)

    def launch(self, reqs: list[Req]) -> StepResult:
        """One decode step's forwards; under overlap scheduling also draft-extend, which
        moves the accepted KV into place (a tensor write) and roots the next step."""
        overlap = self.mode.overlap
        reqs = self.mode.launchable(reqs)
        if not reqs:
            return StepResult([], [], [], overlap=overlap, generations=[])
        generations = [r.retractions for r in reqs] if overlap else None
        outcome = self.graph_step(reqs)
        if outcome is not None:
            return StepResult(reqs, outcome.emitted, [], outcome, overlap=overlap,
                              generations=generations)
        with self.clock.timed("draft"):
            verify_input = self.draft(reqs, self.draft_state.aligned([r.rid for r in reqs]))
        with self.clock.timed("verify"):
            outcome = self.verify(reqs, verify_input)
        if isinstance(self.mode, Overlap):
            with self.clock.timed("extend"):
                self.mode.advance(reqs, outcome.nodes)
                self.install_next(reqs, self.extend_input(outcome, list(range(len(reqs)))))
        return StepResult(reqs, outcome.emitted, [], outcome, overlap=overlap,
                          generations=generations)

    def resolved(self, result: StepResult, kept: list[int]) -> None:
        """After resolve (``kept``: the requests of ``result`` still running): a sequential
        step's draft-extend; an overlap step ran it inside its launch, a step run as one
        graph brought every request's next state, of which the kept rows stay."""
        if self.mode.overlap:
            return
        outcome = result.verify
        assert outcome is not None
        reqs = [result.reqs[i] for i in kept]
        with self.clock.timed("extend"):
            if outcome.next_state is None or not reqs:
                self.install_next(reqs, self.extend_input(outcome, kept))
                return
            state = outcome.next_state
            if len(kept) < len(result.reqs):
                state = state.filter_batch(from_host(kept, state.device))
            self.draft_state.install([r.rid for r in reqs], state)

    def drop(self, rid: str) -> None:
        """A request finished, was aborted or retracted: forget its draft state."""
        self.draft_state.drop(rid)
        self.mode.drop(rid)

    # --- the whole step as one graph -------------------------------------------------------

    def graph_step(self, reqs: list[Req]) -> VerifyOutcome | None:
        """The step's draft, verify, greedy walk and draft-extend as one replay of the graph
        runner's ``spec_step`` (``refengine/graph/step_graph.py``): for a sequential step
        whose requests are all greedy. None when there is no such graph, it does not take the
        batch, or ``one_graph_steps`` is off; the phases then run apart."""
        graph = self.runner.spec_step
        if (graph is None or not self.one_graph_steps or self.mode.overlap
                or not all(r.params.greedy for r in reqs)):
            return None
        state = self.draft_state.aligned([r.rid for r in reqs])
        assert isinstance(state, DraftInput | SeedInput)
        with self.clock.timed("step"):
            found = self.run_step_graph(reqs, state, graph)
            if found is None:
                return None
            nodes, emitted = walked_paths(found[1], found[0])
        return VerifyOutcome(nodes, emitted, None, None, graph.next_state(found))

    def run_step_graph(self, reqs: list[Req], state: DraftInput | SeedInput, graph: StepGraph
                       ) -> StepOutput | None:
        """``graph``'s replay of the step of ``reqs`` from their draft ``state`` (what the
        graph probe compares with the phases run one by one); None when it does not take the
        batch."""
        step = self.draft_step(reqs)
        found: StepOutput | None = graph.run(
            graph.inputs(state, *step.rows_roots_slots(self.spec.num_draft_tokens)),
            max(step.roots))
        return found

    # --- draft ------------------------------------------------------------------------------

    def draft(self, reqs: list[Req], state: RowState) -> VerifyInput:
        """The step's draft (the graph runner's loop when it takes the batch, else eager),
        then the verify tree from what it found."""
        found = self.graph_search(reqs, state)
        if found is None:
            found = self.eager_search(reqs, state)
        return self.to_verify_input(reqs, self.drafter.root_tokens(state), found)

    def graph_search(self, reqs: list[Req], state: RowState,
                     loop: DraftLoopGraph | None = None) -> LoopOutput | None:
        """The draft replayed by ``loop`` (default: the graph runner's); None when there is
        no loop or it does not take the batch."""
        loop = loop or self.runner.draft_loop
        if loop is None:
            return None
        return self.drafter.graph_search(self.draft_step(reqs), state, loop)

    def eager_search(self, reqs: list[Req], state: RowState) -> LoopOutput:
        return self.drafter.eager_search(self.draft_step(reqs), state)

    def to_verify_input(self, reqs: list[Req], root_tokens: torch.Tensor, found: LoopOutput
                        ) -> VerifyInput:
        return verify_input(self._chain, root_tokens, found, self.roots(reqs),
                            self.spec.num_draft_tokens)

    # --- verify -----------------------------------------------------------------------------

    def verify(self, reqs: list[Req], verify_input: VerifyInput) -> VerifyOutcome:
        n = self.spec.num_draft_tokens
        out = self.runner.forward(self.runner.prepare_verify(
            reqs, verify_input, self.reserved_slots(reqs, n), causal=self.spec.topk == 1))
        logits = out.logits.view(len(reqs), n, -1)
        nodes, emitted = accept(reqs, verify_input, logits, self.spec.num_steps,
                                self.sample_path, out.walk)
        return VerifyOutcome(nodes, emitted, out.features.view(len(reqs), n, -1), verify_input)

    def sample_path(self, req: Req, verify_input: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        """Tree speculative sampling for one sampled request (``probs``: [N, V] float64, on
        the CPU); its tree comes to the host in one transfer."""
        tokens, next_token, next_sibling = torch.stack(
            [verify_input.draft_tokens[row], verify_input.retrieve_next_token[row],
             verify_input.retrieve_next_sibling[row]]).tolist()
        return verify_tree_sampling(tokens, next_token, next_sibling, probs, self.spec.num_steps,
                                    req.seed, self.output_index(req))

    def output_index(self, req: Req) -> int:
        """The output index of the first token this step emits for ``req`` (what seeds its
        per-position generator)."""
        return self.mode.output_index(req)

    # --- draft-extend -----------------------------------------------------------------------

    def extend_input(self, outcome: VerifyOutcome, keep: list[int]) -> DraftExtendInput:
        """The accepted runs of the requests ``keep`` (unfinished after verify), in order."""
        if not keep:
            target = self.runner.target
            return DraftExtendInput.idle(target.config.hidden_size, target.lm_head.weight.dtype,
                                         self.runner.device)
        assert outcome.features is not None, "a step run as one graph extends inside it"
        n, device = outcome.features.shape[1], outcome.features.device
        lens = [len(outcome.nodes[i]) for i in keep]
        # A node emits one token (the accepted drafts, then the bonus), so the feature rows and
        # the tokens pair up and travel in one copy.
        packed = from_host([[i * n + j for i in keep for j in outcome.nodes[i]],
                            [t for i in keep for t in outcome.emitted[i]]], device)
        return DraftExtendInput(outcome.features.flatten(0, 1)[packed[0]], packed[1],
                                from_host(lens, device), lens)

    def install_next(self, reqs: list[Req], accepted: DraftExtendInput) -> None:
        """The drafter's next state for ``reqs``; an idle one when every request finished
        inside verify."""
        state = self.draft_extend(reqs, accepted) if reqs else self.drafter.idle()
        self.draft_state.install([r.rid for r in reqs], state)

    def draft_extend(self, reqs: list[Req], accepted: DraftExtendInput) -> RowState:
        """The drafter's next state from the rows ``reqs`` drafted from: the state still
        holds them (a sequential step's finished requests were dropped at resolve, an overlap
        launch aligned it to its batch)."""
        previous = self.draft_state.aligned([r.rid for r in reqs])
        state: RowState = self.drafter.extend(self.draft_step(reqs), previous, accepted,
                                              self.runner.draft_extend)
        return state

    def eager_extend(self, reqs: list[Req], accepted: DraftExtendInput
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's draft-extend forward, eager (what the graph probe compares)."""
        return self._extend_forward().eager_extend(self.draft_step(reqs), accepted)

    def graph_extend(self, reqs: list[Req], accepted: DraftExtendInput,
                     graph: DraftLoopGraph | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``eager_extend`` replayed by ``graph`` (default: the graph runner's extend graph);
        None when there is none or it does not take the batch."""
        graph = graph or self.runner.draft_extend
        if graph is None:
            return None
        return self._extend_forward().graph_extend(self.draft_step(reqs), accepted, graph)

    def _extend_forward(self) -> ExtendForward:
        forward = self.drafter.extend_forward
        if forward is None:
            raise TypeError(f"{type(self.drafter).__name__} has no draft-extend forward")
        return forward
