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
* **draft** (``launch``): the verify block's ``N`` slots are allocated first and the draft
  writes its KV straight into them. Forward 1 runs each request's catch-up positions
  ``[s - behind, s)`` together with the root at ``s`` (one ragged batch: the catch-up costs no
  forward of its own) and gives ``d_1``; forwards ``2 .. S`` run ``d_{i-1}`` at ``s + i - 1``
  (``chain_search``). Every draft token is the argmax: the verify treats drafts as point
  masses, so speculative sampling stays exactly lossless whatever the draft proposes.
* **verify, accept, commit**: EAGLE's on a chain (``accept.py``, ``KVManager.commit_path``).
  The accepted drafts are the tokens the draft ran, so their draft KV is already in place;
  commit frees the rejected part of the block with the target's.
* **after resolve** (``draft_extend``): no forward. The next root is the bonus token; when the
  whole chain was accepted the draft never ran ``d_S``, so ``behind = 1`` (else 0).

When every request finishes inside verify an idle ``CatchUpInput`` is installed (bug class
all-finish-in-verify). Overlap scheduling is refused by ``SpecConfig``.
"""

from __future__ import annotations

import torch

from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.speculative.draft_search import chain_search
from refengine.speculative.eagle_v1 import EagleV1Worker
from refengine.speculative.inputs import CatchUpInput, DraftExtendInput, DraftInput, SeedInput


class DraftModelWorker(EagleV1Worker):
    def idle_input(self) -> CatchUpInput:  # type: ignore[override]
        return CatchUpInput.idle()

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        """The draft writes its KV over the same batch (no logits wanted: the target sampled
        the root); a request whose fill completed gets its state, nothing behind."""
        no_logits = torch.empty((0,), dtype=torch.int64)
        self.runner.forward_draft_model(
            ForwardBatch(batch.input_ids, batch.positions, batch.out_slots, batch.attention,
                         no_logits))
        done = [r.rid for r in reqs if r.rid in sampled]
        self.draft_state.add(done, CatchUpInput(
            torch.tensor([sampled[rid] for rid in done], dtype=torch.int64),
            torch.zeros(len(done), dtype=torch.int64)))

    def root_tokens(self, din: DraftInput | CatchUpInput) -> torch.Tensor:  # type: ignore[override]
        return din.verified_id

    def eager_search(self, reqs: list[Req],  # type: ignore[override]
                     din: DraftInput | SeedInput | CatchUpInput) -> torch.Tensor:
        """-> the chain's draft tokens ``[b, S]``."""
        assert isinstance(din, CatchUpInput)
        roots = self.roots(reqs)
        block = self.verify_slots(reqs)
        behind = din.behind.tolist()
        ids = [t for req, s, k, root in zip(reqs, roots, behind, din.verified_id.tolist(),
                                            strict=True)
               for t in (*req.fill_ids[s - k:s], root)]
        logits, features = self.runner.forward_draft_model(self.runner.prepare_tail(
            reqs, torch.tensor(ids, dtype=torch.int64), [k + 1 for k in behind],
            [s + 1 for s in roots]))
        start = torch.tensor(roots)

        def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            """Draft token ``d_i`` at position ``s + i``, into the block's slot ``i``."""
            return self.runner.forward_draft_model(self.runner.prepare_draft_step(
                reqs, tokens, start + i, block[:, i], 1, (start + i + 1).tolist()))

        first = torch.argmax(logits, dim=-1)[:, None]
        return chain_search(first, features, self.spec.num_steps, forward)

    def draft_extend(self, reqs: list[Req],  # type: ignore[override]
                     ext: DraftExtendInput) -> CatchUpInput:
        """No forward: the root is each run's bonus token; a run of ``S + 1`` (the whole
        chain accepted) leaves ``d_S``'s position behind."""
        last = torch.cumsum(ext.accept_lens, 0) - 1
        return CatchUpInput(ext.input_ids[last],
                            (ext.accept_lens - self.spec.num_steps).clamp(min=0))
