"""Mutants of speculative decoding: verify input left installed after an all-finish
step, draft-extend phase confusion, rejected pages kept, stop conditions checked once per
run, seeds by batch row, positional draft-state filters, draft positions shifted, a wrong
tree parent, a skipped catch-up, and a Frozen-KV draft that writes KV."""

from __future__ import annotations

from dataclasses import replace

import torch

from conformance.backends.mutants.lifecycle import _finish_reason_without
from conformance.backends.mutants.tables import with_draft, with_drafter
from refengine import Engine
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch, KVCache
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req
from refengine.runner import ModelRunner
from refengine.speculative.core import SpeculativeWorker
from refengine.speculative.draft_model import DraftModelDrafter
from refengine.speculative.draft_search import Candidates, LoopOutput
from refengine.speculative.draft_state import DraftState, RowState
from refengine.speculative.drafter import DraftStep
from refengine.speculative.eagle import EagleDrafter
from refengine.speculative.inputs import (
    CatchUpInput,
    DraftExtendInput,
    DraftInput,
    VerifyInput,
)
from refengine.speculative.verify import SampledPath

# --- speculative decoding ---------------------------------------------------------------------

class _LeavesVerifyInput(SpeculativeWorker):
    """Under any drafter (EAGLE's, Frozen-KV MTP's): when nothing is left to extend, the
    step's verify input stays installed instead of an idle state."""

    last_verify_input: VerifyInput | None = None

    def draft(self, reqs: list[Req], state: RowState) -> VerifyInput:
        self.last_verify_input = super().draft(reqs, state)
        return self.last_verify_input

    def install_next(self, reqs: list[Req], extend_input: DraftExtendInput) -> None:
        if reqs:
            super().install_next(reqs, extend_input)
            return
        # the bug itself is a type error: a verify input installed as per-request state
        self.draft_state.install([], self.last_verify_input)  # type: ignore[arg-type]


class AllFinishLeavesVerifyInput(Engine):
    """All-finish-in-verify: when every request finishes inside verify, the verify input stays
    installed as the batch's spec state; the next merge finds no ``merge_batch`` and crashes."""

    worker_class = _LeavesVerifyInput


class _DraftWritesTargetKV(FrozenKVMTPDraftModel):
    def compute(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().compute(input_ids, hidden, positions, attention, kv)
        # BUG: the assistant stores its iteration at its query position, as a decoder layer
        # with a cache of its own would, but into the target's pool it only may read.
        slots = attention.kv_slots.gather(1, positions[:, None].clamp(
            max=attention.kv_slots.shape[1] - 1)).squeeze(1)
        kv.k[self.config.kv_layer, slots] = 0
        kv.v[self.config.kv_layer, slots] = 0
        return out


class FrozenDraftWritesKV(Engine):
    """Frozen draft writes KV: the Frozen-KV MTP assistant writes into the target's KV cache
    (the slots at its query position) instead of only reading it; the target's later forwards
    attend to the damaged entries."""

    draft_classes = with_draft("frozen_kv_mtp", _DraftWritesTargetKV)


class MTPAllFinishLeavesVerifyInput(Engine):
    """All-finish-in-verify under Frozen-KV MTP: when every request finishes inside verify, no
    idle seed is installed (the verify input stays); the next merge finds no ``merge_batch``
    and crashes."""

    worker_class = _LeavesVerifyInput


class _ExtendPhaseConfusion(EagleDrafter):
    def extend(self, step: DraftStep, previous: DraftInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> DraftInput:
        state = super().extend(step, previous, accepted, graph)
        last = torch.cumsum(accepted.accept_lens, 0) - 1
        # The per-accepted-token target features (draft-extend phase) reused as the next draft
        # phase's hidden state: shapes line up, meaning does not.
        return DraftInput(state.topk_p, state.topk_index, accepted.hidden_states[last],
                          state.verified_id)


class DraftExtendPhaseConfusion(Engine):
    """Phase confusion: the draft-extend phase's per-token target features stand in for the draft's
    predicted feature in the next draft phase. Still lossless; acceptance collapses."""

    drafter_classes = with_drafter("eagle", _ExtendPhaseConfusion)


class _KeepsRejectedPages(KVManager):
    def commit_path(self, req: Req, nodes: list[int]) -> None:
        if self.page_size == 1:
            super().commit_path(req, nodes)
            return
        allocated = req.kv_allocated_len
        super().commit_path(req, nodes)
        # The paged path forgets to move the watermark: rejected slots stay reserved.
        self.extend(req, allocated - req.kv_allocated_len)


class RejectedSlotsKeptPaged(Engine):
    """Rejected verify slots are not freed when page_size > 1 (the paged spec path never
    updates the allocation watermark)."""

    kv_manager_class = _KeepsRejectedPages


class _ChecksRunOnce(OutputProcessor):
    def append(self, req: Req, tokens: list[int]) -> FinishReason | None:
        req.output_ids.extend(tokens)
        return self.finish_reason(req) if tokens else None  # sees only the run's last token


class StopInsideRunIgnored(Engine):
    """Finish conditions are checked once per step, after the whole accepted run, instead of
    per token: tokens after a stop (or past max_new_tokens) inside a run are emitted."""

    output_class = _ChecksRunOnce


class _StopStringsAtRunEnd(OutputProcessor):
    def append(self, req: Req, tokens: list[int]) -> FinishReason | None:
        for token in tokens:
            req.output_ids.append(token)
            # BUG: stop tokens and the length limit are checked per token, stop strings only
            # once the whole accepted run is in.
            reason = _finish_reason_without(self, req, stop=())
            if reason is not None:
                return reason
        return self.finish_reason(req) if tokens else None


class StopStringAtRunEnd(Engine):
    """Stop strings are checked once per accepted run (stop tokens still per token): a string
    completed inside a run lets the rest of the run through."""

    output_class = _StopStringsAtRunEnd


class _SeedsByBatchRow(SpeculativeWorker):
    def sample_path(self, req: Req, verify_input: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        # BUG: the verify draws are seeded by the request's row in the batch, not by its seed.
        return super().sample_path(replace(req, seed=row), verify_input, row, probs)


class SeedByBatchRow(Engine):
    """Speculative sampling seeds its draws with the request's row in the verify batch instead
    of the request's seed: the same seed gives other tokens in another batch composition."""

    worker_class = _SeedsByBatchRow


class _PositionalFilter(DraftState):
    def drop(self, rid: str) -> None:
        if rid in self.rids:  # assumes removed rows are a suffix: truncate instead of gather
            self._keep(list(range(len(self.rids) - 1)))


class _PositionalFilterWorker(SpeculativeWorker):
    draft_state_class = _PositionalFilter


class RetractFilterPositional(Engine):
    """A retracted request's draft row is dropped by truncating the batch (sglang's "filter
    can only filter from the back" assumption): rows after a retracted middle request shift."""

    worker_class = _PositionalFilterWorker


class _DraftPositionsShifted(ModelRunner):
    def prepare_draft_step(self, reqs: list[Req], tokens: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, width: int, seen: list[int],
                           masks: list[torch.Tensor] | None = None) -> ForwardBatch:
        return super().prepare_draft_step(reqs, tokens, positions + 1, slots, width, seen, masks)


class DraftPositionShift(Engine):
    """The draft head's step-i nodes are placed one position too far (``s + i`` instead of
    ``s + i - 1``): their rotary phase is off by one. Verification is untouched, so output stays
    exactly lossless; only acceptance drops, at some verify steps."""

    runner_class = _DraftPositionsShifted


def reparent_to_best(parents: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """BUG: every candidate below the first step hangs under the best-scoring node of its true
    parent's generation (step 1: ``k`` nodes, step i > 1: ``k*k``) instead of its own parent.
    That node is always selected before any of its (new) children, so the tree stays valid."""
    out = parents.clone()
    for r in range(parents.shape[0]):
        for c, p in enumerate(parents[r].tolist()):
            if p < 0:
                continue
            lo, width = (0, k) if p < k else (k + (p - k) // (k * k) * k * k, k * k)
            out[r, c] = lo + int(torch.argmax(scores[r, lo:lo + width]))
    return out


class _WrongParentTree(SpeculativeWorker):
    def to_verify_input(self, reqs: list[Req], root_tokens: torch.Tensor, found: LoopOutput
                        ) -> VerifyInput:
        if isinstance(found, Candidates):
            found = Candidates(found.scores, found.tokens,
                               reparent_to_best(found.parents, found.scores, self.spec.topk))
        return super().to_verify_input(reqs, root_tokens, found)


class TreeWrongParent(Engine):
    """The verify tree is assembled with wrong parents (each deeper draft token under the best
    node of its parent's step): the tree is consistent, so verification stays lossless, but the
    draft tokens are checked in contexts they were not drafted for and acceptance drops."""

    worker_class = _WrongParentTree


class _CatchUpSkipped(DraftModelDrafter):
    def extend(self, step: DraftStep, state: CatchUpInput, accepted: DraftExtendInput,
               graph: DraftLoopGraph | None) -> CatchUpInput:
        caught = super().extend(step, state, accepted, graph)
        return CatchUpInput(caught.verified_id, torch.zeros_like(caught.behind))


class DraftCatchUpSkipped(Engine):
    """A standalone draft model never catches up on the last draft of a fully accepted chain:
    that position keeps no draft KV, and later drafts attend to a hole. Verification is
    untouched (lossless); acceptance drops after every fully accepted step."""

    drafter_classes = with_drafter("draft_model", _CatchUpSkipped)
