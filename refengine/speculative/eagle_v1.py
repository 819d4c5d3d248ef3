"""EAGLE V1 (sequential): draft -> verify -> draft-extend, one decode step at a time.

Positions: a decoding request with ``s = kv_committed_len`` has its root (the newest emitted
token, ``verified_id``) at position ``s``; its KV is written by this step's verify.

* draft: ``S - 1`` forwards of the draft head over a beam of ``k`` nodes per request. Step-i
  nodes sit at position ``s + i - 1`` and write scratch KV at row positions
  ``s + (i-1)k .. s + ik - 1``; each attends to the committed prefix and to its own ancestors'
  scratch entries. The scratch pages come from the allocator's scratch bracket, so drafting
  leaves the pool exactly as it found it. The best ``N - 1`` of all candidates by path score
  form the tree (``kernels.tree_reference``). A chain (``k = 1``) is the tree itself, with
  causal attention: ``draft_chain`` skips the beam and score work.
* verify: ``N`` slots per request at positions ``s .. s+N-1`` (root + drafts, positions
  ``s + depth``), one tree-masked target forward, then a greedy walk or tree speculative
  sampling per request.
* resolve (``OutputProcessor``, after the per-token finish checks): ``KVManager.commit_path``
  moves the accepted nodes' KV to the contiguous positions ``s+1 ..``, commits them and frees
  the slots past them (whole pages only).
* draft-extend (``resolved``): the head over the accepted positions (``f_p``, ``x_{p+1}``)
  writes its KV and yields the next ``DraftInput``; when every request finished inside verify,
  an idle ``DraftInput`` is installed instead, so the next merge works.

The worker owns its ``DraftState`` and runs every forward through the ``ModelRunner``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refengine.clock import PhaseClock
from refengine.config import SpecConfig
from refengine.kernels.tree_reference import build_tree_reference, select_candidates
from refengine.memory.manager import KVManager
from refengine.memory.reservation import DecodeReservation
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.accept import accept
from refengine.speculative.draft_search import (
    Candidates,
    DraftForward,
    LoopOutput,
    search,
    top_k,
)
from refengine.speculative.draft_state import DraftState

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph
from refengine.speculative.inputs import DraftExtendInput, DraftInput, VerifyInput
from refengine.speculative.verify import SampledPath, verify_tree_sampling
from refengine.step import StepResult


@dataclass
class VerifyOutcome:
    """Per request: accepted nodes (root first) and the tokens they emit (drafts + bonus)."""

    nodes: list[list[int]]
    emitted: list[list[int]]
    features: torch.Tensor       # [b, N, H] target features at every tree node
    verify_input: VerifyInput


class ChainTree:
    """The verify tree of a chain (``topk == 1``) of ``n`` nodes: node i sits at depth i, sees
    nodes 0..i (causal), has parent i - 1 and first child i + 1. It never changes, so its
    tensors are built once per batch size and handed out as views (consumers read a
    VerifyInput, they never write it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.depth = torch.arange(n)
        self._by_batch: dict[int, dict[str, torch.Tensor]] = {}

    def _structure(self, b: int) -> dict[str, torch.Tensor]:
        """The VerifyInput fields that depend only on the batch size."""
        if b not in self._by_batch:
            n, node = self.n, self.depth
            self._by_batch[b] = {
                "tree_mask": (node[None, :] <= node[:, None]).expand(b, n, n),
                "parents": (node - 1).expand(b, n),
                "retrieve_index": torch.arange(b * n).view(b, n),
                "retrieve_next_token": torch.where(node < n - 1, node + 1, -1).expand(b, n),
                "retrieve_next_sibling": torch.full((b, n), -1)}
        return self._by_batch[b]

    def verify_input(self, tokens: torch.Tensor, start: torch.Tensor) -> VerifyInput:
        """``tokens [b, n]`` (root first); ``start [b]``: each root's position."""
        return VerifyInput(draft_tokens=tokens, positions=start[:, None] + self.depth,
                           **self._structure(tokens.shape[0]))


class EagleV1Worker:
    """EAGLE V1 as a ``SpecWorker``: draft -> verify in ``launch``, draft-extend in
    ``resolved``."""

    draft_state_class: type[DraftState] = DraftState  # an extension point (the bug zoo)

    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager,
                 clock: PhaseClock) -> None:
        self.spec = spec
        self.runner = runner
        self.kv = kv
        self.clock = clock
        self._chain = ChainTree(spec.num_steps + 1)
        self.draft_state = self.draft_state_class(self.idle_input())

    @property
    def reach(self) -> int:
        """KV positions past a request's committed end a decode step writes: the verify block
        or the draft scratch, whichever is longer."""
        return max(self.spec.num_draft_tokens, self.spec.topk * (self.spec.num_steps - 1))

    @property
    def reservation(self) -> DecodeReservation:
        return DecodeReservation(self.reach)

    @property
    def reserve_bound(self) -> int:
        return 0  # commit frees everything past the accepted run

    def roots(self, reqs: list[Req]) -> list[int]:
        """Each request's root position: its committed end (verify commits before the next
        step starts)."""
        return [r.kv_committed_len for r in reqs]

    @contextmanager
    def drafting_from_committed_end(self, reqs: list[Req]) -> Iterator[None]:
        """Lets ``reqs`` (committed, in no step, reserved by the caller) draft one step from
        their committed end, as if just scheduled for decode: what the graph probe runs a
        draft kind on. V1 drafts from the committed end anyway: nothing to set up."""
        yield

    def reserved(self, reqs: list[Req], tokens: int) -> torch.Tensor:
        """``[len(reqs), tokens]`` reserved slots from each root on (the scheduler reserved
        them: the draft scratch and the verify block)."""
        roots = self.roots(reqs)
        short = [r.rid for r, s in zip(reqs, roots, strict=True)
                 if s + tokens > r.kv_allocated_len]
        if short:
            raise RuntimeError(f"requests {short} have no reservation for {tokens} positions "
                               "past their root")
        return self.kv.block_slots(reqs, roots, tokens)

    def scratch_slots(self, reqs: list[Req], tokens: int) -> torch.Tensor:
        """Draft KV slots for ``tokens`` positions past each root, ``[len(reqs), tokens]``."""
        return self.reserved(reqs, tokens)

    def verify_slots(self, reqs: list[Req]) -> torch.Tensor:
        """``[len(reqs), N]`` slots for the verify block, past each root."""
        return self.reserved(reqs, self.spec.num_draft_tokens)

    @property
    def hidden_size(self) -> int:
        return self.runner.target.config.hidden_size

    def idle_input(self) -> DraftInput:
        return DraftInput.idle(self.spec.topk, self.hidden_size,
                               self.runner.target.lm_head.weight.dtype)

    def drop(self, rid: str) -> None:
        self.draft_state.drop(rid)

    # --- prefill: the draft over the prompt ---------------------------------------------------

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        """Pair each prefilled position p with the token after it: the next fill token, or the
        sampled token where a request's fill ends (never the sampled token at a chunk
        boundary: bug class "chunked prefill breaks the draft chain"). Requests whose fill
        completed get their draft state."""
        next_ids: list[int] = []
        last_rows: list[int] = []
        offset = 0
        for req, n in zip(reqs, lens, strict=True):
            start, fill = req.kv_committed_len, req.fill_ids
            following = fill[start + 1:start + n + 1]
            if len(following) < n:
                following = [*following, sampled[req.rid]]
                last_rows.append(offset + n - 1)
            next_ids.extend(following)
            offset += n
        done = [r for r in reqs if r.rid in sampled]
        rows = self.draft_prefill(
            batch, features, torch.tensor(next_ids), torch.tensor(last_rows, dtype=torch.int64),
            torch.tensor([sampled[r.rid] for r in done], dtype=torch.int64))
        self.draft_state.add([r.rid for r in done], rows)

    def draft_prefill(self, batch: ForwardBatch, features: torch.Tensor, next_ids: torch.Tensor,
                      last_rows: torch.Tensor, roots: torch.Tensor) -> DraftInput:
        """Run the head over a target prefill batch. ``next_ids[t]`` is the token after flat
        token t (the next prompt token, or the sampled one at a prompt's end); ``last_rows`` are
        the flat rows of requests whose prompt completed (their new draft state)."""
        draft_batch = self.runner.prepare_draft_prefill(batch, next_ids, last_rows)
        logits, predicted = self.runner.forward_draft(draft_batch, features)
        topk_p, topk_index = top_k(logits, self.spec.topk)
        return DraftInput(topk_p, topk_index, predicted, roots)

    # --- the decode step ----------------------------------------------------------------------

    def launch(self, reqs: list[Req]) -> StepResult:
        with self.clock.timed("draft"):
            verify_input = self.draft(reqs, self.draft_state.aligned([r.rid for r in reqs]))
        with self.clock.timed("verify"):
            outcome = self.verify(reqs, verify_input)
        return StepResult(reqs, outcome.emitted, [], outcome)

    def resolved(self, result: StepResult, kept: list[int]) -> None:
        assert result.verify is not None
        with self.clock.timed("extend"):
            self.install_next([result.reqs[i] for i in kept],
                              self.extend_input(result.verify, kept))

    def install_next(self, reqs: list[Req], extend_input: DraftExtendInput) -> None:
        """All-finish-in-verify: when every request finished inside verify there is nothing to
        extend; an idle DraftInput (zero rows, right dtypes) is installed so the next merge
        works."""
        draft_input = (self.draft_extend(reqs, extend_input) if reqs else self.idle_input())
        self.draft_state.install([r.rid for r in reqs], draft_input)

    # --- draft ----------------------------------------------------------------------------------

    def draft(self, reqs: list[Req], din: DraftInput) -> VerifyInput:
        """The step's draft loop (the graph runner's when it takes the batch, else eager),
        then the verify tree from what it found."""
        found = self.graph_search(reqs, din)
        if found is None:
            found = self.eager_search(reqs, din)
        return self.to_verify_input(reqs, self.root_tokens(din), found)

    def root_tokens(self, din: DraftInput) -> torch.Tensor:
        return din.verified_id

    def graph_search(self, reqs: list[Req], din: DraftInput,
                     loop: DraftLoopGraph | None = None) -> LoopOutput | None:
        """The whole draft loop replayed on static buffers by ``loop`` (default: the graph
        runner's), the scratch slots staged with the rest; None when there is no loop or it
        does not take the batch."""
        loop = loop or self.runner.draft_loop
        if loop is None:
            return None
        k, steps = self.spec.topk, self.spec.num_steps
        return loop.run({"topk_p": din.topk_p, "topk_index": din.topk_index,
                         "hidden": din.hidden_states,
                         "rows": torch.tensor([r.row for r in reqs], dtype=torch.int64),
                         "roots": torch.tensor(self.roots(reqs), dtype=torch.int64),
                         "scratch": self.scratch_slots(reqs, k * (steps - 1))})

    def eager_search(self, reqs: list[Req], din: DraftInput) -> LoopOutput:
        """``topk == 1``: the beam is a single path, so the tree is the chain itself
        (``N = S + 1``, every candidate kept) and ``chain_search`` skips the beam, score and
        mask bookkeeping, which costs a decode step as much as a head forward (same tree as
        ``beam_search`` with one node: ``tests/test_spec_engine.py`` checks it)."""
        k, steps = self.spec.topk, self.spec.num_steps
        with self.draft_forwards(reqs, k) as forward:
            return search(din.topk_p, din.topk_index, din.hidden_states, steps, forward)

    def to_verify_input(self, reqs: list[Req], root_tokens: torch.Tensor, found: LoopOutput
                        ) -> VerifyInput:
        """A chain (the root, then its draft tokens) is its tree; of a beam's candidates the
        best ``N - 1`` by path score form the tree (``kernels.tree_reference``). The root
        always comes from the step's state (``root_tokens``), never from a graph's output."""
        seq = torch.tensor(self.roots(reqs))
        if not isinstance(found, Candidates):
            return self._chain.verify_input(torch.cat([root_tokens[:, None], found], dim=1), seq)
        n, b = self.spec.num_draft_tokens, len(reqs)
        tree = build_tree_reference(root_tokens, found.tokens, found.parents,
                                    select_candidates(found.scores, n))
        flat = torch.arange(b)[:, None] * n + torch.arange(n)[None, :]
        return VerifyInput(tree.tokens, tree.mask, seq[:, None] + tree.depth, tree.parents,
                           flat, tree.next_token, tree.next_sibling)

    @contextmanager
    def draft_forwards(self, reqs: list[Req], width: int) -> Iterator[DraftForward]:
        """The draft's eager forwards of one step, ``width`` nodes per request: step-i nodes
        sit at position ``s + i - 1`` and write scratch KV at row positions ``s + (i-1)w ..
        s + iw - 1``, seeing the committed prefix and (``node_mask``, None: causal) the
        scratch entries of their ancestors."""
        steps = self.spec.num_steps
        seq = torch.tensor(self.roots(reqs))
        slots = self.scratch_slots(reqs, width * (steps - 1))

        def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            positions = (seq[:, None] + (i - 1)).expand(len(reqs), width).reshape(-1)
            masks = (None if node_mask is None
                     else [node_mask[r, :, :i * width] for r in range(len(reqs))])
            fb = self.runner.prepare_draft_step(
                reqs, tokens, positions, slots[:, (i - 1) * width:i * width].reshape(-1),
                width, (seq + i * width).tolist(), masks)
            return self.runner.forward_draft(fb, features)
        yield forward

    # --- verify -----------------------------------------------------------------------------

    def verify(self, reqs: list[Req], vin: VerifyInput) -> VerifyOutcome:
        n = self.spec.num_draft_tokens
        out = self.runner.forward(self.runner.prepare_verify(
            reqs, vin, self.verify_slots(reqs), causal=self.spec.topk == 1))
        logits = out.logits.view(len(reqs), n, -1)
        nodes, emitted = accept(reqs, vin, logits, self.spec.num_steps, self.sample_path)
        return VerifyOutcome(nodes, emitted, out.features.view(len(reqs), n, -1), vin)

    def sample_path(self, req: Req, vin: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        """Tree speculative sampling for one sampled request (``probs``: [N, V] float64)."""
        return verify_tree_sampling(
            vin.draft_tokens[row].tolist(), vin.retrieve_next_token[row].tolist(),
            vin.retrieve_next_sibling[row].tolist(), probs, self.spec.num_steps, req.seed,
            self.output_index(req))

    def output_index(self, req: Req) -> int:
        """The output index of the first token this step emits for ``req`` (what seeds its
        per-position generator): V1 resolved every earlier step already."""
        return len(req.output_ids)

    def extend_input(self, outcome: VerifyOutcome, keep: list[int]) -> DraftExtendInput:
        """Rows of the requests ``keep`` (unfinished after verify), in that order."""
        if not keep:
            return DraftExtendInput.idle(self.hidden_size, outcome.features.dtype)
        n = outcome.features.shape[1]
        flat = torch.tensor([i * n + j for i in keep for j in outcome.nodes[i]])
        return DraftExtendInput(outcome.features.flatten(0, 1)[flat],
                                torch.tensor([t for i in keep for t in outcome.emitted[i]]),
                                torch.tensor([len(outcome.nodes[i]) for i in keep]))

    # --- draft-extend -----------------------------------------------------------------------

    def draft_extend(self, reqs: list[Req], ext: DraftExtendInput) -> DraftInput:
        """The head over each request's accepted positions (already committed): replayed by
        the graph runner's extend graph when it takes the batch, else forward by forward."""
        found = self.graph_extend(reqs, ext)
        logits, predicted = found if found is not None else self.eager_extend(reqs, ext)
        topk_p, topk_index = top_k(logits, self.spec.topk)
        last = torch.cumsum(ext.accept_lens, 0) - 1  # each request's newest accepted token
        return DraftInput(topk_p, topk_index, predicted, ext.input_ids[last])

    def eager_extend(self, reqs: list[Req], ext: DraftExtendInput
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's forward over the accepted positions -> (logits, predicted features) at
        each request's last one."""
        fb = self.runner.prepare_draft_extend(reqs, ext, self.roots(reqs))
        return self.runner.forward_draft(fb, ext.hidden_states)

    def graph_extend(self, reqs: list[Req], ext: DraftExtendInput,
                     graph: DraftLoopGraph | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``eager_extend`` replayed by ``graph`` (default: the graph runner's extend graph);
        None when there is none or it does not take the batch."""
        graph = graph or self.runner.draft_extend
        if graph is None:
            return None
        return graph.extend(torch.tensor([r.row for r in reqs], dtype=torch.int64),
                            torch.tensor(self.roots(reqs), dtype=torch.int64),
                            ext.accept_lens, ext.input_ids, ext.hidden_states)
