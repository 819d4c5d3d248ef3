"""Mutants only acceptance shows: a drafter that misses part of what the target saw. Each is
lossless (the target's KV and verification are whole) and memory-neutral (every slot is
allocated, counted and freed as before); the golden tier's chunked, session and retraction
traces kill them, per verify step."""

from __future__ import annotations

import torch

from conformance.backends.mutants.tables import with_drafter
from refengine import Engine
from refengine.memory.manager import KVManager
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.speculative.eagle import EagleDrafter
from refengine.speculative.inputs import DraftInput


class _DraftPrefillOnLastChunk(EagleDrafter):
    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> DraftInput:
        if not sampled:
            # BUG: no request completed its fill, so there seems to be no draft state to
            # build; but the head's KV over these chunks is never written either.
            return self.idle()
        return super().prefill(reqs, lens, batch, features, sampled)


class DraftSkipsNonFinalChunks(Engine):
    """Chunked prefill, draft side: EAGLE's draft prefill runs only in prefill steps that
    complete some request's prompt, so the head's KV for a long prompt's earlier chunks (a
    step of nothing but middle chunks) is never written and later drafts attend to holes."""

    drafter_classes = with_drafter("eagle", _DraftPrefillOnLastChunk)


class _KeepsTargetKVOnly(KVManager):
    def keep(self, req: Req, length: int) -> int | None:
        row = super().keep(req, length)
        if row is not None and self.draft_pool is not None:
            # BUG: the session keeps the target's KV of its context; the draft's is dropped.
            slots = self.rows.table[row, :length]
            self.draft_pool.k[:, slots] = 0
            self.draft_pool.v[:, slots] = 0
        return row


class SessionDropsDraftKV(Engine):
    """Session continuation, draft side: between turns a session keeps the target's KV of its
    context but not the draft's (left zeroed), so a continuing turn's draft sees nothing of
    the inherited context: it drafts as if the conversation began with the turn's tokens."""

    kv_manager_class = _KeepsTargetKVOnly


class _DraftFromPromptFeature(EagleDrafter):
    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> DraftInput:
        features = features.clone()
        offset = 0
        for req, n in zip(reqs, lens, strict=True):
            start = req.kv_committed_len
            prompt_last = len(req.prompt_ids) - 1
            if req.rid in sampled and req.output_ids and start <= prompt_last < start + n:
                # BUG: the fill's last row is taken where the prompt ends, as on a first
                # prefill; a re-prefill's fill goes on with the output so far.
                features[offset + n - 1] = features[offset + prompt_last - start]
            offset += n
        return super().prefill(reqs, lens, batch, features, sampled)


class DraftAfterRetractFromPromptFeature(Engine):
    """Retraction, draft side: a retracted request re-prefills its prompt and its output so
    far, and EAGLE's draft prefill takes the target's feature for the fill's last position
    from where the prompt ends, so after every retraction the head drafts (and writes its KV
    there) from the prompt's last feature instead of the re-prefilled context's."""

    drafter_classes = with_drafter("eagle", _DraftFromPromptFeature)
