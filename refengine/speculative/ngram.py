"""N-gram speculation (prompt lookup): the chain is copied from the request's own context, no
draft model (``SpecConfig(algorithm="ngram")``, ``ngram_lookup.py``).

Positions and S, N as every chain's: a decoding request's root (the newest emitted token) sits
at position ``s``; a step proposes ``S = num_steps`` tokens and verifies the chain of
``N = S + 1`` nodes (root first).

* **state** (``NgramInput``): each request's context, prompt and output up to the root, in a
  fixed-width row (the context limit plus the verify block, so every row merges with every
  other), and the root. The drafter owns it: under overlap scheduling a step is launched
  before the previous one is resolved, so the request's output lags the truth.
* **prefill**: a request whose fill completed gets its row, ``fill_ids`` and the sampled root
  (its whole fill: every chunk, and a session's inherited context). A chunk mid-prompt needs
  nothing.
* **draft**: the lookup over each context (``propose``), tensor work only, no forward.
* **verify, accept, commit**: the core's on a chain. The proposal is deterministic, so its draft
  distribution is a point mass on each token: exactly what the verify assumes of every draft
  (greedy walk; speculative sampling accepts a child with probability ``p(token)``, a
  rejection draws from the residual), so sampled output follows the target's law too.
* **after verify** (``extend``): no forward; each accepted run (accepted drafts, then the
  bonus, which is the next root) is written at its positions, ending at the new root.

No model, no KV: the step's reservation is the verify block alone and the KV manager gets no
draft pool, so every memory invariant holds as for plain decoding plus the block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refengine.config import NGRAM_MAX, NGRAM_MIN, SpecConfig
from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import Runner
from refengine.speculative.draft_search import LoopOutput
from refengine.speculative.drafter import DraftStep
from refengine.speculative.inputs import DraftExtendInput, NgramInput
from refengine.speculative.ngram_lookup import propose

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph


class NgramDrafter:
    scratch_positions = 0  # no draft forward writes KV
    extend_forward = None  # no draft-extend forward of its own

    def __init__(self, spec: SpecConfig, runner: Runner) -> None:
        self.spec = spec
        self.device = runner.device
        # Every position a context can reach: a root stays below the context limit, and a
        # verify appends at most N tokens after it.
        self.width = runner.target.config.max_position_embeddings + spec.num_draft_tokens

    def idle(self) -> NgramInput:
        return NgramInput.idle(self.width, self.device)

    def root_tokens(self, state: NgramInput) -> torch.Tensor:
        return state.verified_id

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> NgramInput:
        """Each request whose fill completed: its whole fill and the sampled root."""
        contexts = [[*r.fill_ids, sampled[r.rid]] for r in reqs if r.rid in sampled]
        empty = torch.zeros((len(contexts), self.width), dtype=torch.int64, device=self.device)
        tokens = self.written(empty, [0] * len(contexts), [len(c) for c in contexts],
                              from_host([t for c in contexts for t in c], self.device))
        return NgramInput(from_host([c[-1] for c in contexts], self.device), tokens)

    def graph_search(self, step: DraftStep, state: NgramInput, loop: DraftLoopGraph
                     ) -> LoopOutput | None:
        return None  # no forward to replay: the lookup is a few tensor ops

    def eager_search(self, step: DraftStep, state: NgramInput) -> LoopOutput:
        """-> the chain's draft tokens ``[b, S]``: the lookup over contexts ending at the
        roots (only as wide as the longest)."""
        lens = [s + 1 for s in step.roots]
        return propose(state.tokens[:, :max(lens, default=1)], from_host(lens, step.device),
                       self.spec.num_steps, NGRAM_MIN, NGRAM_MAX)

    def extend(self, step: DraftStep, state: NgramInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> NgramInput:
        """``state``'s contexts with each accepted run written at its positions: the run of
        ``a`` tokens ends at the request's new root ``s'`` (``step.roots``), so it fills
        ``s' - a + 1 .. s'``."""
        runs = accepted.host_lens()
        starts = [s - a + 1 for s, a in zip(step.roots, runs, strict=True)]
        tokens = self.written(state.tokens, starts, runs, accepted.input_ids)
        last = torch.cumsum(accepted.accept_lens, 0) - 1
        return NgramInput(accepted.input_ids[last], tokens)

    def written(self, tokens: torch.Tensor, starts: list[int], lens: list[int],
                values: torch.Tensor) -> torch.Tensor:
        """A copy of ``tokens`` with row i's positions ``starts[i] ..`` (``lens[i]`` of them)
        set to the next ``lens[i]`` of ``values`` (flat, row by row). Positions come from the
        host, so no value is read back."""
        rows = [i for i, n in enumerate(lens) for _ in range(n)]
        cols = [s + j for s, n in zip(starts, lens, strict=True) for j in range(n)]
        return tokens.index_put((from_host(rows, self.device), from_host(cols, self.device)),
                                values)
