"""EAGLE's drafter: a draft head over the target's features that keeps KV of its own.

Positions: a decoding request's root (the newest emitted token) sits at position ``s``.

* prefill: the head runs over the target's prefill batch, each position paired with the token
  after it, and gives the requests whose fill completed their first ``DraftInput``.
* draft: ``S - 1`` head forwards over a beam of ``k`` nodes per request. Step-i nodes sit at
  position ``s + i - 1`` and write scratch KV at row positions ``s + (i-1)k .. s + ik - 1``
  (reserved slots); each attends to the committed prefix and to its own ancestors' scratch
  entries. A chain (``k = 1``) is the tree itself, with causal attention.
* extend (after verify): the head over each request's accepted positions writes their KV and
  yields the next ``DraftInput``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refengine.config import SpecConfig
from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import Runner
from refengine.speculative.draft_search import DraftForward, LoopOutput, search, top_k
from refengine.speculative.drafter import DraftStep, ExtendForward
from refengine.speculative.inputs import DraftExtendInput, DraftInput

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph


class EagleDrafter:
    def __init__(self, spec: SpecConfig, runner: Runner) -> None:
        self.spec = spec
        self.runner = runner

    @property
    def scratch_positions(self) -> int:
        return self.spec.topk * (self.spec.num_steps - 1)

    @property
    def extend_forward(self) -> ExtendForward:
        return self

    def idle(self) -> DraftInput:
        target = self.runner.target
        return DraftInput.idle(self.spec.topk, target.config.hidden_size,
                               target.lm_head.weight.dtype, self.runner.device)

    def root_tokens(self, state: DraftInput) -> torch.Tensor:
        return state.verified_id

    # --- prefill: the head over the prompt ----------------------------------------------------

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> DraftInput:
        """Pair each prefilled position p with the token after it: the next fill token, or the
        sampled token where a request's fill ends (never the sampled token at a chunk
        boundary: bug class "chunked prefill breaks the draft chain")."""
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
        device = self.runner.device
        roots = from_host([sampled[r.rid] for r in reqs if r.rid in sampled], device)
        draft_batch = self.runner.prepare_draft_prefill(
            batch, from_host(next_ids, device), from_host(last_rows, device))
        logits, predicted = self.runner.forward_draft(draft_batch, features)
        topk_p, topk_index = top_k(logits, self.spec.topk)
        return DraftInput(topk_p, topk_index, predicted, roots)

    # --- draft --------------------------------------------------------------------------------

    def graph_search(self, step: DraftStep, state: DraftInput, loop: DraftLoopGraph
                     ) -> LoopOutput | None:
        """The whole draft loop replayed on static buffers, the scratch slots staged with the
        rest."""
        rows, roots, scratch = step.rows_roots_slots(self.scratch_positions)
        return loop.run({"topk_p": state.topk_p, "topk_index": state.topk_index,
                         "hidden": state.hidden_states, "rows": rows, "roots": roots,
                         "scratch": scratch}, max(step.roots))

    def eager_search(self, step: DraftStep, state: DraftInput) -> LoopOutput:
        """``search``: the chain for ``topk == 1`` (no beam, score or mask bookkeeping), else
        the beam."""
        return search(state.topk_p, state.topk_index, state.hidden_states,
                      self.spec.num_steps, self.forwards(step, self.spec.topk))

    def forwards(self, step: DraftStep, width: int) -> DraftForward:
        """The head's eager forwards of one step, ``width`` nodes per request: step-i nodes
        sit at position ``s + i - 1`` and write scratch KV at row positions ``s + (i-1)w ..
        s + iw - 1``, seeing the committed prefix and (``node_mask``, None: causal) the
        scratch entries of their ancestors."""
        reqs, seq = step.reqs, step.root_positions
        slots = step.slots(width * (self.spec.num_steps - 1))

        def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            positions = (seq[:, None] + (i - 1)).expand(len(reqs), width).reshape(-1)
            masks = (None if node_mask is None
                     else [node_mask[r, :, :i * width] for r in range(len(reqs))])
            batch = self.runner.prepare_draft_step(
                reqs, tokens, positions, slots[:, (i - 1) * width:i * width].reshape(-1),
                width, [s + i * width for s in step.roots], masks)
            return self.runner.forward_draft(batch, features)
        return forward

    # --- extend -------------------------------------------------------------------------------

    def extend(self, step: DraftStep, state: DraftInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> DraftInput:
        """The head over each request's accepted positions (ending at its root): replayed by
        ``graph`` when it takes the batch, else forward by forward."""
        found = None if graph is None else self.graph_extend(step, accepted, graph)
        logits, predicted = found if found is not None else self.eager_extend(step, accepted)
        topk_p, topk_index = top_k(logits, self.spec.topk)
        last = torch.cumsum(accepted.accept_lens, 0) - 1  # each request's newest accepted token
        return DraftInput(topk_p, topk_index, predicted, accepted.input_ids[last])

    def eager_extend(self, step: DraftStep, accepted: DraftExtendInput
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's forward over the accepted positions -> (logits, predicted features) at
        each request's last one."""
        batch = self.runner.prepare_draft_extend(step.reqs, accepted, step.roots)
        return self.runner.forward_draft(batch, accepted.hidden_states)

    def graph_extend(self, step: DraftStep, accepted: DraftExtendInput, graph: DraftLoopGraph
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``eager_extend`` replayed by ``graph``; None when it does not take the batch."""
        rows, roots, _ = step.rows_roots_slots(0)  # the accepted runs end at the roots
        return graph.extend(rows, roots, max(step.roots, default=0), accepted)
