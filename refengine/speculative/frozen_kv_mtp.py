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
  commit and the overlap mode are the core's (``speculative/core.py``), as for EAGLE.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from refengine.config import SpecConfig
from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import Runner
from refengine.speculative.draft_search import LoopOutput, search, top_k
from refengine.speculative.drafter import DraftStep
from refengine.speculative.inputs import DraftExtendInput, SeedInput

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph


class FrozenKVMTPDrafter:
    scratch_positions = 0  # the assistant writes no KV
    extend_forward = None  # no draft-extend forward of its own

    def __init__(self, spec: SpecConfig, runner: Runner) -> None:
        self.spec = spec
        self.runner = runner

    def idle(self) -> SeedInput:
        target = self.runner.target
        return SeedInput.idle(target.config.hidden_size, target.lm_head.weight.dtype,
                              self.runner.device)

    def root_tokens(self, state: SeedInput) -> torch.Tensor:
        return state.bonus_tokens

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> SeedInput:
        """A request whose fill completed gets its seed: the sampled token and the feature at
        its last fill position. A chunk mid-prompt needs nothing (no draft KV to fill)."""
        ends = list(itertools.accumulate(lens))
        done = [i for i, r in enumerate(reqs) if r.rid in sampled]
        device = self.runner.device
        return SeedInput(from_host([sampled[reqs[i].rid] for i in done], device),
                         features[from_host([ends[i] - 1 for i in done], device)])

    def graph_search(self, step: DraftStep, state: SeedInput, loop: DraftLoopGraph
                     ) -> LoopOutput | None:
        """The graph runner's loop folds the seed in as iteration 0: it takes the bonus
        tokens and target features as they are, and produces the first candidates itself."""
        rows, seq_lens, _ = step.rows_roots_slots(0)
        return loop.run({"bonus_tokens": state.bonus_tokens, "hidden": state.hidden_states,
                         "rows": rows, "seq_lens": seq_lens}, max(step.roots))

    def eager_search(self, step: DraftStep, state: SeedInput) -> LoopOutput:
        """The seed iteration turns the state into the first candidates (what EAGLE's
        draft-extend leaves behind), then EAGLE's chain or beam search runs the rest. Every
        forward of the step reads the same committed prefix from the same position, so they
        share one batch (``topk`` rows per request; the seed runs on every ``topk``-th row);
        the beam's node masks do not apply (no node sees another: there is no draft KV)."""
        k, b = self.spec.topk, len(step.reqs)
        batch = self.runner.prepare_frozen_draft(step.reqs, step.roots, k)
        logits, hidden = self.runner.forward_frozen_draft(
            batch, state.bonus_tokens, state.hidden_states,
            rows=torch.arange(0, b * k, k, device=step.device))
        topk_p, topk_index = top_k(logits, k)

        def forward(i: int, tokens: torch.Tensor, hidden: torch.Tensor,
                    node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return self.runner.forward_frozen_draft(batch, tokens, hidden)
        return search(topk_p, topk_index, hidden, self.spec.num_steps, forward)

    def extend(self, step: DraftStep, state: SeedInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> SeedInput:
        """No forward: each request's seed is its run's last (token, feature) pair."""
        last = torch.cumsum(accepted.accept_lens, 0) - 1
        return SeedInput(accepted.input_ids[last], accepted.hidden_states[last])
