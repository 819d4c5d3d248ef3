"""Mutants of n-gram speculation: contexts the lookup reads that are not the request's. Each is
lossless (the verify still checks every draft), so only acceptance shows it: the golden tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conformance.backends.mutants.tables import with_drafter
from refengine import Engine
from refengine.device import from_host
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.speculative.drafter import DraftStep
from refengine.speculative.inputs import DraftExtendInput, NgramInput
from refengine.speculative.ngram import NgramDrafter

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph


class _ContextSkipsBonus(NgramDrafter):
    def extend(self, step: DraftStep, state: NgramInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> NgramInput:
        grown = super().extend(step, state, accepted, graph)
        # BUG: the accepted drafts are appended but the bonus is not (the sampled token arrives
        # after the context was updated): each new root's position keeps what the row held.
        rows = torch.arange(grown.batch_size, device=grown.device)
        roots = from_host(step.roots, grown.device)
        return NgramInput(grown.verified_id,
                          grown.tokens.index_put((rows, roots), state.tokens[rows, roots]))


class NgramContextSkipsBonus(Engine):
    """N-gram context without the bonus token: after a verify the context gets the accepted
    drafts but not the bonus token (the next root), so every lookup's suffix ends in a hole.
    The root itself is right, so verification stays lossless; acceptance collapses."""

    drafter_classes = with_drafter("ngram", _ContextSkipsBonus)


class _ContextFromLastChunk(NgramDrafter):
    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> NgramInput:
        state = super().prefill(reqs, lens, batch, features, sampled)
        # BUG: the context is fed from the tokens this prefill computed: a prompt's earlier
        # chunks and a session's cached prefix (before kv_committed_len) never enter it.
        tokens = state.tokens.clone()
        for i, req in enumerate(r for r in reqs if r.rid in sampled):
            tokens[i, :req.kv_committed_len] = 0
        return NgramInput(state.verified_id, tokens)


class NgramContextFromLastChunk(Engine):
    """N-gram context from the last prefill chunk: the lookup's context holds only the tokens
    of the prefill that completed the request (its final chunk; a session turn's new tokens),
    so matches in a prompt's earlier chunks or a session's earlier turns are never found.
    Lossless; a prompt prefilled in one step is untouched (the chunked trace has none, the
    plain trace's batch only those its prefill budget splits)."""

    drafter_classes = with_drafter("ngram", _ContextFromLastChunk)
