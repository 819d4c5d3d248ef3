"""Draft-model speculation (sequential): a standalone draft LM proposes a chain, the target
verifies it (``SpecConfig(algorithm="draft_model")``, ``model/standalone_draft.py``).

Positions and S, N as EAGLE's chain: a decoding request with ``s = kv_committed_len`` has its
root (the newest emitted token) at position ``s``; a step drafts ``S = num_steps`` tokens and
verifies the chain of ``N = S + 1`` nodes (root first).

The draft keeps KV of its own in the KV manager's draft pool, at the target's slots (one
allocator, one row table), so its KV is allocated, counted and freed with the request's: on
finish, abort and retraction alike. Between steps it covers the committed prefix except the
``behind`` positions the state names.

* **prefill**: the draft runs over the target's prefill batch itself (same tokens, positions,
  slots and attention): its KV then covers the fill, chunk by chunk, as the target's does.
* **draft**: the draft writes its KV straight into the verify block's ``N`` reserved slots.
  Forward 1 runs each request's catch-up positions ``[s - behind, s)`` together with the root
  at ``s`` (one ragged batch: the catch-up costs no forward of its own) and gives ``d_1``;
  forwards ``2 .. S`` run ``d_{i-1}`` at ``s + i - 1`` (``chain_search``). Every draft token
  is the argmax: the verify treats drafts as point masses, so speculative sampling stays
  exactly lossless whatever the draft proposes.
* **verify, accept, commit**: the core's on a chain (``accept.py``, ``KVManager.commit_path``).
  The accepted drafts are the tokens the draft ran, so their draft KV is already in place;
  commit frees the rejected part of the block with the target's.
* **after resolve** (``extend``): no forward. The next root is the bonus token; when the
  whole chain was accepted the draft never ran ``d_S``, so ``behind = 1`` (else 0).

Overlap scheduling is refused by ``SpecConfig``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refengine.config import SpecConfig
from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import Runner
from refengine.speculative.draft_search import LoopOutput, chain_search
from refengine.speculative.drafter import DraftStep
from refengine.speculative.inputs import CatchUpInput, DraftExtendInput

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph


class DraftModelDrafter:
    scratch_positions = 0  # the draft's KV goes into the verify block
    extend_forward = None  # no draft-extend forward of its own

    def __init__(self, spec: SpecConfig, runner: Runner) -> None:
        self.spec = spec
        self.runner = runner

    def idle(self) -> CatchUpInput:
        return CatchUpInput.idle(self.runner.device)

    def root_tokens(self, state: CatchUpInput) -> torch.Tensor:
        return state.verified_id

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> CatchUpInput:
        """The draft writes its KV over the same batch (no logits wanted: the target sampled
        the root); a request whose fill completed gets its state, nothing behind."""
        device = self.runner.device
        no_logits = torch.empty((0,), dtype=torch.int64, device=device)
        self.runner.forward_draft_model(
            self.runner.prepare_draft_prefill(batch, batch.input_ids, no_logits))
        done = [r.rid for r in reqs if r.rid in sampled]
        return CatchUpInput(from_host([sampled[rid] for rid in done], device),
                            torch.zeros(len(done), dtype=torch.int64, device=device))

    def graph_search(self, step: DraftStep, state: CatchUpInput, loop: DraftLoopGraph
                     ) -> LoopOutput | None:
        return None  # a standalone draft model drafts forward by forward (no loop graph)

    def eager_search(self, step: DraftStep, state: CatchUpInput) -> LoopOutput:
        """-> the chain's draft tokens ``[b, S]``."""
        reqs, roots = step.reqs, step.roots
        block = step.slots(self.spec.num_draft_tokens)
        behind, root_ids = torch.stack([state.behind, state.verified_id]).tolist()  # one sync
        ids = [t for req, s, k, root in zip(reqs, roots, behind, root_ids, strict=True)
               for t in (*req.fill_ids[s - k:s], root)]
        logits, features = self.runner.forward_draft_model(self.runner.prepare_tail(
            reqs, from_host(ids, step.device), [k + 1 for k in behind],
            [s + 1 for s in roots]))
        start = step.root_positions

        def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            """Draft token ``d_i`` at position ``s + i``, into the block's slot ``i``."""
            return self.runner.forward_draft_model(self.runner.prepare_draft_step(
                reqs, tokens, start + i, block[:, i], 1, [s + i + 1 for s in roots]))

        first = torch.argmax(logits, dim=-1)[:, None]
        return chain_search(first, features, self.spec.num_steps, forward)

    def extend(self, step: DraftStep, state: CatchUpInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> CatchUpInput:
        """No forward: the root is each run's bonus token; a run of ``S + 1`` (the whole
        chain accepted) leaves ``d_S``'s position behind."""
        last = torch.cumsum(accepted.accept_lens, 0) - 1
        return CatchUpInput(accepted.input_ids[last],
                            (accepted.accept_lens - self.spec.num_steps).clamp(min=0))
