"""Frozen-KV MTP: a draft ("assistant") that keeps no KV of its own.

The assistant's attention layers only query: they read the target's KV of the committed prefix
and never write any (``refengine/model/frozen_kv_mtp.py``). What carries from one draft
iteration to the next is a recurrent vector of the target's width. Against EAGLE V1 that changes:

* **State between steps** is a ``SeedInput`` per request: the root token and the target's
  feature at the position that produced it. After a prefill that is the sampled token and the
  last prompt position's feature; after a verify, the last accepted run's bonus token and the
  feature at its last accepted node. Selecting it needs no forward: there is no draft-extend
  pass and no draft prefill (nothing to fill).
* **Drafting** runs ``S`` assistant forwards, the first being the seed (root token + target
  feature -> the first candidates), then EAGLE's chain or beam search over the assistant's own
  recurrent vectors. Every iteration's query sits at ``max(seq_len - 1, 0)`` and sees
  ``[0, seq_len)`` of the target's KV, so one attention-metadata build serves the whole step;
  ``topk > 1`` repeats each request's rows ``topk`` times. Siblings and ancestors do not see
  each other through attention (there is no draft KV): a path's context is its vector.
* **No draft KV slots**: a decode step needs the verify block only. Verify, the accept rule,
  commit and the overlap (V2) layer are EAGLE's unchanged.

When every request finishes inside verify an idle (zero-row) ``SeedInput`` is installed, so the
next merge works (bug class all-finish-in-verify).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from refengine.model.llama import ForwardBatch

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph
from refengine.request import Req
from refengine.speculative.draft_search import DraftForward, LoopOutput, top_k
from refengine.speculative.eagle_v1 import EagleV1Worker
from refengine.speculative.eagle_v2 import EagleV2Worker
from refengine.speculative.inputs import DraftExtendInput, DraftInput, SeedInput


class FrozenKVMTPWorker(EagleV1Worker):
    # The current decode step's batch: built once in ``draft`` and shared by all its forwards.
    _step_batch: ForwardBatch
    @property
    def reach(self) -> int:
        return self.spec.num_draft_tokens  # the verify block; drafting takes no slots

    def idle_input(self) -> SeedInput:  # type: ignore[override]
        return SeedInput.idle(self.hidden_size, self.runner.target.lm_head.weight.dtype)

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        """A request whose fill completed gets its seed: the sampled token and the feature at
        its last fill position. A chunk mid-prompt needs nothing (no draft KV to fill)."""
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        done = [i for i, r in enumerate(reqs) if r.rid in sampled]
        seed = SeedInput(torch.tensor([sampled[reqs[i].rid] for i in done], dtype=torch.int64),
                         features[ends[done]] if done else features[:0])
        self.draft_state.add([reqs[i].rid for i in done], seed)

    def root_tokens(self, din: DraftInput | SeedInput) -> torch.Tensor:  # type: ignore[override]
        assert isinstance(din, SeedInput)
        return din.bonus_tokens

    def graph_search(self, reqs: list[Req], din: DraftInput | SeedInput,  # type: ignore[override]
                     loop: DraftLoopGraph | None = None) -> LoopOutput | None:
        """The graph runner's loop folds the seed in as iteration 0: it takes the bonus
        tokens and target features as they are, and produces the first candidates itself."""
        loop = loop or self.runner.draft_loop
        if loop is None:
            return None
        assert isinstance(din, SeedInput)
        return loop.run({"bonus_tokens": din.bonus_tokens, "hidden": din.hidden_states,
                         "rows": torch.tensor([r.row for r in reqs], dtype=torch.int64),
                         "seq_lens": torch.tensor(self.roots(reqs), dtype=torch.int64)})

    def eager_search(self, reqs: list[Req], din: DraftInput | SeedInput  # type: ignore[override]
                     ) -> LoopOutput:
        """The seed iteration turns the state into the first candidates (what EAGLE's
        draft-extend leaves behind), then EAGLE's chain or beam search runs the rest. The
        step's batch (``topk`` rows per request) is built once; the seed runs on every
        ``topk``-th row of it."""
        assert isinstance(din, SeedInput)
        k = self.spec.topk
        self._step_batch = self.runner.prepare_frozen_draft(reqs, self.roots(reqs), k)
        logits, hidden = self.runner.forward_frozen_draft(
            self._step_batch, din.bonus_tokens, din.hidden_states,
            rows=torch.arange(0, len(reqs) * k, k))
        topk_p, topk_index = top_k(logits, k)
        return super().eager_search(reqs, DraftInput(topk_p, topk_index, hidden,
                                                     din.bonus_tokens))

    @contextmanager
    def draft_forwards(self, reqs: list[Req], width: int) -> Iterator[DraftForward]:
        """Every forward of the step reads the same committed prefix from the same position,
        so they share the step's batch; the beam's node masks do not apply (no node sees
        another: there is no draft KV)."""
        batch = self._step_batch
        assert batch.input_ids.shape[0] == len(reqs) * width, "eager_search builds the step batch"

        def forward(i: int, tokens: torch.Tensor, hidden: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return self.runner.forward_frozen_draft(batch, tokens, hidden)
        yield forward

    def draft_extend(self, reqs: list[Req], ext: DraftExtendInput  # type: ignore[override]
                     ) -> SeedInput:
        """No forward: each request's seed is its run's last (token, feature) pair."""
        last = torch.cumsum(ext.accept_lens, 0) - 1
        return SeedInput(ext.input_ids[last], ext.hidden_states[last])


class FrozenKVMTPV2Worker(EagleV2Worker, FrozenKVMTPWorker):
    """Frozen-KV MTP under overlap scheduling: EAGLE V2's reservation, pre-claim and one-step
    late resolution around this module's draft (method resolution puts the overlap layer
    first, then the MTP draft, then EAGLE V1's verify)."""
