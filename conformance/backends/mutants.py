"""The bug zoo: the reference engine with one real bug class planted, as a backend.

Each mutant is the engine with one component class replaced (scheduler, KV manager, model
runner, graph runner, output processor, speculative worker or its draft state) by a subclass
overriding a single method (or naming a broken part of its own: the graph runner's staging);
nothing here is a flag in the production path, and no mutant overrides a method of the engine
itself. ``specgate mutants`` runs the suite against every mutant, and every one must be
killed by some check: a suite that cannot kill its mutants has no teeth. Wherever a backend is
named, a mutant is ``mutant:<name>``.

These model bug classes from production engines (``docs/bug-classes.md``): leaked KV, leaked
request rows, stale state after retraction, off-by-one length checks, dropped stop conditions,
ignored sampling seeds, batch-dependent attention, stale graph padding (a mutant that opens
with the graph runner on, ``Mutant.graphs``), lossless draft-side regressions that only
acceptance shows (the golden tier's per-step check); and speculative-sampling bugs that only
show in the distribution of sampled tokens: ``biased_verify_sampler`` (the distribution tier's
negative control) and verify paths that misapply top-p or temperature. Mutants of shared code
written as source patches live in ``source_mutants.py``. A mutant with ``spec`` other than
"none" behaves exactly like the reference engine under plain decoding.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch

from conformance.adapter import OpenConfig, SamplingParams
from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from refengine import Engine
from refengine.graph.draft_loop import DraftLoopGraph, LoopStaging
from refengine.graph.runner import GraphRunner
from refengine.graph.staging import DUMMY_SLOT, StagedViews, Staging, StepInputs
from refengine.memory.kv_pool import KVPool
from refengine.memory.manager import KVManager
from refengine.memory.view import ceil_page
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle import EagleDraftModel
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req
from refengine.runner import ModelRunner
from refengine.scheduler import Scheduler
from refengine.spec.draft_model import DraftModelWorker
from refengine.spec.draft_search import Candidates, LoopOutput
from refengine.spec.draft_state import DraftState
from refengine.spec.eagle_v1 import EagleV1Worker, VerifyOutcome
from refengine.spec.frozen_kv_mtp import FrozenKVMTPWorker
from refengine.spec.inputs import (
    CatchUpInput,
    DraftExtendInput,
    DraftInput,
    SeedInput,
    VerifyInput,
)
from refengine.spec.verify import SampledPath, verify_tree_sampling
from refengine.step import StepResult
from refengine.stopping import finish_reason

WorkerTable = dict[tuple[str, bool], type[EagleV1Worker]]


def with_worker(algorithm: str, worker: type[EagleV1Worker],
                table: WorkerTable | None = None) -> WorkerTable:
    """A worker table (the reference engine's by default) with ``algorithm``'s sequential
    (V1) worker replaced."""
    return {**(Engine.worker_classes if table is None else table), (algorithm, False): worker}


def with_draft(algorithm: str, draft: type[FrozenKVMTPDraftModel]
               ) -> dict[str, type[EagleDraftModel] | type[FrozenKVMTPDraftModel]]:
    """The reference engine's draft-model table with ``algorithm``'s loader replaced."""
    return {**Engine.draft_classes, algorithm: draft}


class _LeakLastPage(KVManager):
    def release(self, req: Req) -> None:
        if req.row is not None and req.finish_reason in ("stop", "length"):
            # The page loop stops one page short; the row is returned, the page never is.
            self.truncate(req, self.page_size)
            self.rows.free_row(req.row)
            req.row = None
            return
        super().release(req)


class LeakOnFinish(Engine):
    """KV slots leak by one page per finished request."""

    kv_manager_class = _LeakLastPage


class _AbortKeepsRow(KVManager):
    def release(self, req: Req) -> None:
        if req.finish_reason == "abort" and req.row is not None:
            self.truncate(req, 0)
            req.row = None  # the row is dropped without going back to the pool
            return
        super().release(req)


class AbortLeaksRow(Engine):
    """Abort returns the KV slots but not the request row."""

    kv_manager_class = _AbortKeepsRow


class _AbortStaysRunning(Scheduler):
    def remove(self, req: Req) -> None:
        if req.finish_reason == "abort" and req in self.running:
            return  # BUG: the aborted request is never taken off the running list
        super().remove(req)


class AbortStaysRunning(Engine):
    """An aborted request stays in the running list: it no longer decodes, but it keeps its
    running slot (and a retraction may pick it and bring it back to life)."""

    scheduler_class = _AbortStaysRunning


class _ReleaseKeepsCommitted(KVManager):
    def release(self, req: Req) -> None:
        committed = req.kv_committed_len
        super().release(req)
        if req.finish_reason is None:  # a retraction (finish and abort set a reason first)
            req.kv_committed_len = committed  # stale: the re-prefill skips what it "has"


class RetractStaleCommitted(Engine):
    """Retraction frees the KV but leaves the committed length behind."""

    kv_manager_class = _ReleaseKeepsCommitted


class _LengthOffByOne(OutputProcessor):
    def finish_reason(self, req: Req) -> FinishReason | None:
        reason = super().finish_reason(req)
        if reason == "length" and len(req.output_ids) == req.params.max_new_tokens:
            return None
        return reason


class MaxNewTokensOffByOne(Engine):
    """The length limit is compared with ``>`` instead of ``>=``: one token too many."""

    output_class = _LengthOffByOne


def _finish_reason_without(out: OutputProcessor, req: Req, **dropped: tuple[()]
                           ) -> FinishReason | None:
    """The reference finish check with some of the request's stop conditions dropped."""
    return finish_reason(replace(req.params, **dropped), req.output_ids, req.seq_len,
                         out.eos_token_id, out.max_context_len, out.decode)


class _DropsStopTokenIds(OutputProcessor):
    def finish_reason(self, req: Req) -> FinishReason | None:
        return _finish_reason_without(self, req, stop_token_ids=())


class IgnoresStopTokenIds(Engine):
    """``stop_token_ids`` is dropped on the way to the finish check (EOS still works)."""

    output_class = _DropsStopTokenIds


class _DropsRequestSeed(Scheduler):
    def add(self, req: Req) -> None:
        # BUG: the request's own seed is lost on the way in; it draws as an unseeded request
        # would, from a seed derived from its request id.
        req.seed = zlib.crc32(req.rid.encode()) % (2**31)
        super().add(req)


class SeedIgnored(Engine):
    """A per-request seed is silently ignored: every request draws from a seed derived from its
    request id. Draws stay independent and correctly distributed; only reproducibility breaks."""

    scheduler_class = _DropsRequestSeed


class _LongestMaskRunner(ModelRunner):
    def attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                           seq_lens: list[int], masks: list[torch.Tensor] | None = None
                           ) -> AttentionMetadata:
        meta = super().attention_metadata(rows, extend_lens, seq_lens, masks)
        if masks is not None:  # speculative tree masks: this bug lives in plain batches
            return meta
        longest = max(seq_lens)
        for b, n in enumerate(extend_lens):
            meta.mask[b, 0, :n, :longest - n] = True  # every cached position "visible"
        return meta


class BatchLeaksAcrossRows(Engine):
    """Keys are masked by the batch's longest length instead of each request's own, so a
    short request attends to stale slots of its row: output depends on its batch-mates."""

    runner_class = _LongestMaskRunner


# A draft tree as the verifier saw it: (path of tokens below the root, children's tokens in
# sibling order) for every node, sorted; hashable, so identical trees count together.
DraftTree = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def draft_tree(tokens: list[int], next_token: list[int], next_sibling: list[int]) -> DraftTree:
    """The tree of one request's ``VerifyInput`` row, by tokens instead of node indices."""
    nodes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    while stack:
        node, path = stack.pop()
        children = []
        child = next_token[node]
        while child != -1:
            children.append(child)
            child = next_sibling[child]
        nodes.append((path, tuple(tokens[c] for c in children)))
        stack.extend((c, (*path, tokens[c])) for c in children)
    return tuple(sorted(nodes))


def _residual_is_p(p: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """BUG: the rejected children stay in. A rejected draft token can come back as the bonus,
    so each child ``c`` is emitted with ``p(c) + (1 - sum p(children)) p(c)`` instead of
    ``p(c)``: draft tokens are over-weighted."""
    return p


class _ResidualIsP(EagleV1Worker):
    """Samples with the biased residual, and records each draft tree per root sequence in
    ``trees`` so the distribution tier can derive this mutant's exact output distribution (its
    negative-control power)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.trees: dict[tuple[int, ...], Counter[DraftTree]] = {}

    def sample_path(self, req: Req, vin: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        tokens = vin.draft_tokens[row].tolist()
        next_token = vin.retrieve_next_token[row].tolist()
        next_sibling = vin.retrieve_next_sibling[row].tolist()
        root = (*req.prompt_ids, *req.output_ids)
        self.trees.setdefault(root, Counter())[draft_tree(tokens, next_token, next_sibling)] += 1
        return verify_tree_sampling(tokens, next_token, next_sibling, probs, self.spec.num_steps,
                                    req.seed, self.output_index(req), residual=_residual_is_p)


class _MTPResidualIsP(_ResidualIsP, FrozenKVMTPWorker):
    """The same biased residual over Frozen-KV MTP's draft (the verify path is shared)."""


class _DraftModelResidualIsP(_ResidualIsP, DraftModelWorker):
    """The same biased residual over a standalone draft model's chain."""


def verified_draft_trees(handle: object) -> dict[tuple[int, ...], Counter[DraftTree]]:
    """The draft trees a ``biased_verify_sampler`` handle verified, per root sequence: what the
    distribution tier needs to derive this negative control's exact output law. Asked of the
    mutant that recorded them, so the suite never reaches into a handle itself."""
    worker = getattr(getattr(handle, "engine", None), "worker", None)
    if not isinstance(worker, _ResidualIsP):
        raise TypeError("verified_draft_trees: not a biased_verify_sampler handle")
    return worker.trees


class BiasedVerifySampler(Engine):
    """Speculative sampling draws the bonus after a rejection from the target distribution
    itself instead of the residual without the rejected drafts: draft tokens are over-weighted.

    Greedy output is untouched, every emitted token is in the support and each run is
    reproducible; only the distribution of sampled tokens is wrong. Plain decoding (no
    speculation) is exactly the reference engine's."""

    worker_classes = with_worker("draft_model", _DraftModelResidualIsP, with_worker(
        "frozen_kv_mtp", _MTPResidualIsP, with_worker("eagle", _ResidualIsP)))


# --- speculative decoding (EAGLE V1) -------------------------------------------------------------

class _LeavesVerifyInput(EagleV1Worker):
    """Over any V1-style worker (EAGLE's, Frozen-KV MTP's): when nothing is left to extend,
    the step's verify input stays installed instead of an idle state."""

    last_verify_input: VerifyInput | None = None

    def draft(self, reqs: list[Req], din: DraftInput | SeedInput) -> VerifyInput:
        self.last_verify_input = super().draft(reqs, din)  # type: ignore[arg-type]
        return self.last_verify_input

    def install_next(self, reqs: list[Req], extend_input: DraftExtendInput) -> None:
        if reqs:
            super().install_next(reqs, extend_input)
            return
        self.draft_state.install([], self.last_verify_input)  # type: ignore[arg-type]


class AllFinishLeavesVerifyInput(Engine):
    """All-finish-in-verify: when every request finishes inside verify, the verify input stays
    installed as the batch's spec state; the next merge finds no ``merge_batch`` and crashes."""

    worker_classes = with_worker("eagle", _LeavesVerifyInput)


class _MTPLeavesVerifyInput(_LeavesVerifyInput, FrozenKVMTPWorker):
    pass


class _DraftWritesTargetKV(FrozenKVMTPDraftModel):
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, kv: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(input_ids, hidden, positions, attention, kv)
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

    worker_classes = with_worker("frozen_kv_mtp", _MTPLeavesVerifyInput)


class _ExtendPhaseConfusion(EagleV1Worker):
    def draft_extend(self, reqs: list[Req], ext: DraftExtendInput) -> DraftInput:
        din = super().draft_extend(reqs, ext)
        last = torch.cumsum(ext.accept_lens, 0) - 1
        # The per-accepted-token target features (draft-extend phase) reused as the next draft
        # phase's hidden state: shapes line up, meaning does not.
        return DraftInput(din.topk_p, din.topk_index, ext.hidden_states[last], din.verified_id)


class DraftExtendPhaseConfusion(Engine):
    """Phase confusion: the draft-extend phase's per-token target features stand in for the draft's
    predicted feature in the next draft phase. Still lossless; acceptance collapses."""

    worker_classes = with_worker("eagle", _ExtendPhaseConfusion)


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


class _SeedsByBatchRow(EagleV1Worker):
    def sample_path(self, req: Req, vin: VerifyInput, row: int, probs: torch.Tensor
                    ) -> SampledPath:
        # BUG: the verify draws are seeded by the request's row in the batch, not by its seed.
        return super().sample_path(replace(req, seed=row), vin, row, probs)


class SeedByBatchRow(Engine):
    """Speculative sampling seeds its draws with the request's row in the verify batch instead
    of the request's seed: the same seed gives other tokens in another batch composition."""

    worker_classes = with_worker("eagle", _SeedsByBatchRow)


class _PositionalFilter(DraftState):
    def drop(self, rid: str) -> None:
        if rid in self.rids:  # assumes removed rows are a suffix: truncate instead of gather
            self._keep(list(range(len(self.rids) - 1)))


class _PositionalFilterWorker(EagleV1Worker):
    draft_state_class = _PositionalFilter


class RetractFilterPositional(Engine):
    """A retracted request's draft row is dropped by truncating the batch (sglang's "filter
    can only filter from the back" assumption): rows after a retracted middle request shift."""

    worker_classes = with_worker("eagle", _PositionalFilterWorker)


# --- overlap scheduling (EAGLE V2) ---------------------------------------------------------------

class _AppliesStaleResults(OutputProcessor):
    def is_stale(self, result: StepResult, i: int) -> bool:
        return False  # BUG: a late result is applied whatever happened to its request


class StaleResultApplied(Engine):
    """Stale result: an overlap step's result is applied to a request that finished, was
    aborted or retracted after the step was launched (tokens for a dead request, acceptance
    counted, KV committed that is no longer its own)."""

    output_class = _AppliesStaleResults


class _AbortKeepsReservation(KVManager):
    def release(self, req: Req) -> None:
        if req.finish_reason == "abort" and req.row is not None:
            # BUG: the abort path frees only what is committed; the reservation past it is
            # forgotten, never returned to the pool.
            req.kv_allocated_len = ceil_page(req.kv_committed_len, self.page_size)
        super().release(req)


class AbortLeaksReservation(Engine):
    """Over-allocation not freed on abort: an aborted request's overlap reservation past its
    committed end leaks (invisible without a reservation, i.e. under V1)."""

    kv_manager_class = _AbortKeepsReservation


class _NoPreClaim(KVManager):
    def reserve_for_decode(self, req: Req, reserve_tokens: int) -> None:
        # The same reservation end as the reference (committed + 1 + 2L, the root included),
        # but the root's slot is not pre-claimed: resolution commits the whole run instead.
        need = self.reserve_need(req, reserve_tokens - 1)
        if need:
            self.extend(req, need)


class _CommitsWholeRunLate(OutputProcessor):
    def commit_run(self, req: Req, nodes: list[int], overlap: bool) -> None:
        if overlap:
            self.kv.commit(req, len(nodes))  # the root included, one step after its launch
            return
        super().commit_run(req, nodes, overlap)


class LateCommit(Engine):
    """Late commit under overlap scheduling: a step's KV (its root included) is committed only
    when the step is resolved, instead of pre-claiming the root at schedule time. A turn that
    finishes while its next step is in flight ends one token short, so its streaming session
    inherits a cached prefix one short."""

    kv_manager_class = _NoPreClaim
    output_class = _CommitsWholeRunLate


# --- graph runner -------------------------------------------------------------------------------

class _StalePaddedRowsStaging(Staging):
    def stage(self, step: StepInputs | None, bucket: int) -> StagedViews:
        raw = 0 if step is None else step.batch_size
        rows = self.buffers["rows"]
        left = rows[raw:bucket].clone()
        views = super().stage(step, bucket)
        rows[raw:bucket] = left  # BUG: the padded rows keep whatever an earlier batch left
        return views


class _StalePaddedRowsGraphRunner(GraphRunner):
    staging_class = _StalePaddedRowsStaging


class StalePaddedRows(Engine):
    """Stale padded rows: graph staging rewrites every field of the padded rows but their
    request rows (req_pool_indices), so after a bigger batch a padded row keeps a real
    request's row and its attention gathers that request's KV. The outputs are sliced to the
    real rows and the padded rows still write the dummy slot: only the padding itself shows.
    """

    graph_runner_class = _StalePaddedRowsGraphRunner


class _CaptureTimeBonusTokens(LoopStaging):
    """Restages every buffer but ``bonus_tokens``, which only the first staging of a bucket
    (its capture) writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._captured: set[int] = set()
        self._replaying = False

    def stage(self, inputs: dict[str, torch.Tensor] | None, bucket: int
              ) -> dict[str, torch.Tensor]:
        self._replaying = bucket in self._captured
        self._captured.add(bucket)
        return super().stage(inputs, bucket)

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        if name == "bonus_tokens" and self._replaying:
            return  # BUG: the seed iteration replays the capture-time step's bonus tokens
        super().restage(name, buf, value, raw, bucket)


def loop_staging_runner(staging: type[LoopStaging]) -> type[GraphRunner]:
    """A graph runner whose draft loops and extend graph stage through ``staging``."""
    loop = type(f"{staging.__name__}Loop", (DraftLoopGraph,), {"staging_class": staging})
    return type(f"{staging.__name__}GraphRunner", (GraphRunner,), {"draft_loop_class": loop})


class BonusTokensNotRestaged(Engine):
    """Bonus tokens not restaged: the graph-captured Frozen-KV MTP draft loop folds the seed
    iteration in, but its ``bonus_tokens`` buffer is written only when a bucket is captured,
    so every later replay seeds the draft with an earlier step's tokens. Verify still decides
    every token (output stays lossless); only acceptance drops."""

    graph_runner_class = loop_staging_runner(_CaptureTimeBonusTokens)


class _RealColumnsOnly(LoopStaging):
    """Stages a draft-extend's slots column by column for the accepted tokens only: the front
    padding inside a real request's row keeps whatever an earlier replay staged there."""

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        if name == "slots" and value is not None:
            real = value != DUMMY_SLOT
            buf[:raw][real] = value[real]  # BUG: padded columns keep a stale request's slots
            buf[raw:bucket] = self.fields[name].fill
            return
        super().restage(name, buf, value, raw, bucket)


class ExtendPaddingNotRestaged(Engine):
    """Draft-extend padding not restaged: a graphed EAGLE draft-extend pads each request's
    accepted tokens to a fixed width, and the padded columns' KV slots are left as an earlier
    replay staged them, so the head writes junk KV into slots that now belong to live
    positions. Verify still decides every token (output stays lossless); the drafts that read
    that KV get worse."""

    graph_runner_class = loop_staging_runner(_RealColumnsOnly)


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


class _WrongParentTree(EagleV1Worker):
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

    worker_classes = with_worker("eagle", _WrongParentTree)


class _CatchUpSkipped(DraftModelWorker):
    def draft_extend(self, reqs: list[Req], ext: DraftExtendInput) -> CatchUpInput:
        caught = super().draft_extend(reqs, ext)
        return CatchUpInput(caught.verified_id, torch.zeros_like(caught.behind))


class DraftCatchUpSkipped(Engine):
    """A standalone draft model never catches up on the last draft of a fully accepted chain:
    that position keeps no draft KV, and later drafts attend to a hole. Verification is
    untouched (lossless); acceptance drops after every fully accepted step."""

    worker_classes = with_worker("draft_model", _CatchUpSkipped)


# --- sampling parameters on the verify path ----------------------------------------------------

def drop_top_p(params: SamplingParams) -> SamplingParams:
    """BUG: top-p never reaches the verify path (temperature and top-k do)."""
    return replace(params, top_p=1.0)


def drop_temperature(params: SamplingParams) -> SamplingParams:
    """BUG: the verify path scores at temperature 1 (the temperature reaches only the plain
    sampler); greedy requests stay greedy."""
    return params if params.greedy else replace(params, temperature=1.0)


class _VerifyParamsAltered(EagleV1Worker):
    """Verify sees each sampled request's params through ``verify_params``: its target
    distribution is built from them, while the plain (prefill) sampler uses the real ones."""

    verify_params: ClassVar[Callable[[SamplingParams], SamplingParams]]

    def verify(self, reqs: list[Req], vin: VerifyInput) -> VerifyOutcome:
        own = [req.params for req in reqs]
        for req in reqs:
            req.params = type(self).verify_params(req.params)
        try:
            return super().verify(reqs, vin)
        finally:
            for req, params in zip(reqs, own, strict=True):
                req.params = params


class _VerifyIgnoresTopP(_VerifyParamsAltered):
    verify_params = staticmethod(drop_top_p)


class _VerifyIgnoresTemperature(_VerifyParamsAltered):
    verify_params = staticmethod(drop_temperature)


class VerifyIgnoresTopP(Engine):
    """Top-p ignored in verify: speculative verification samples from the target distribution
    without top-p filtering while plain sampling applies it, so tokens outside the nucleus are
    emitted after the first. Greedy output is untouched."""

    worker_classes = with_worker("eagle", _VerifyIgnoresTopP)


class VerifyTemperatureMisapplied(Engine):
    """Temperature misapplied in verify: verification scores the target at temperature 1
    (the temperature reaches only the plain sampler), so every verified token follows the
    untempered law. Greedy output is untouched."""

    worker_classes = with_worker("eagle", _VerifyIgnoresTemperature)


# The verify-path parameter bugs, by mutant name: their exact output law follows from the
# altered params alone (verification stays exact for them), which the distribution tier uses
# to report its power against each.
VERIFY_PARAM_BUGS: dict[str, Callable[[SamplingParams], SamplingParams]] = {
    "verify_ignores_top_p": drop_top_p,
    "verify_temperature_misapplied": drop_temperature,
}


@dataclass(frozen=True)
class Mutant:
    name: str
    engine_class: type[Engine]
    spec: str = "none"  # the --spec under which the bug is visible (and which runs it)
    # The graph executor the mutant's engine always opens with (its bug lives in the graph
    # runner, which a run without --graphs would never reach); None: as the suite asks.
    graphs: Literal["replay", "compiled", "frozen"] | None = None

    @property
    def bug_class(self) -> str:
        doc = (self.engine_class.__doc__ or "").strip()
        return " ".join(doc.split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("leak_on_finish", LeakOnFinish),
    Mutant("abort_leaks_row", AbortLeaksRow),
    Mutant("abort_stays_running", AbortStaysRunning),
    Mutant("retract_stale_committed", RetractStaleCommitted),
    Mutant("max_new_tokens_off_by_one", MaxNewTokensOffByOne),
    Mutant("ignores_stop_token_ids", IgnoresStopTokenIds),
    Mutant("batch_leaks_across_rows", BatchLeaksAcrossRows),
    Mutant("biased_verify_sampler", BiasedVerifySampler, spec="eagle"),
    Mutant("all_finish_leaves_verify_input", AllFinishLeavesVerifyInput, spec="eagle"),
    Mutant("draft_extend_phase_confusion", DraftExtendPhaseConfusion, spec="eagle"),
    Mutant("rejected_slots_kept_paged", RejectedSlotsKeptPaged, spec="eagle"),
    Mutant("stop_inside_run_ignored", StopInsideRunIgnored, spec="eagle"),
    Mutant("retract_filter_positional", RetractFilterPositional, spec="eagle"),
    Mutant("stale_result_applied", StaleResultApplied, spec="eagle-v2"),
    Mutant("abort_leaks_reservation", AbortLeaksReservation, spec="eagle-v2"),
    Mutant("late_commit", LateCommit, spec="eagle-v2"),
    Mutant("mtp_all_finish_leaves_verify_input", MTPAllFinishLeavesVerifyInput, spec="mtp"),
    Mutant("frozen_draft_writes_kv", FrozenDraftWritesKV, spec="mtp"),
    Mutant("stale_padded_rows", StalePaddedRows, graphs="replay"),
    Mutant("bonus_tokens_not_restaged", BonusTokensNotRestaged, spec="mtp", graphs="replay"),
    Mutant("extend_padding_not_restaged", ExtendPaddingNotRestaged, spec="eagle",
           graphs="replay"),
    Mutant("seed_ignored", SeedIgnored),
    Mutant("seed_by_batch_row", SeedByBatchRow, spec="eagle"),
    Mutant("stop_string_at_run_end", StopStringAtRunEnd, spec="eagle"),
    Mutant("draft_position_shift", DraftPositionShift, spec="eagle"),
    Mutant("tree_wrong_parent", TreeWrongParent, spec="eagle-tree"),
    Mutant("draft_catch_up_skipped", DraftCatchUpSkipped, spec="draft-model"),
    Mutant("verify_ignores_top_p", VerifyIgnoresTopP, spec="eagle"),
    Mutant("verify_temperature_misapplied", VerifyTemperatureMisapplied, spec="eagle"),
]}


class MutantBackend(RefEngineBackend):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"
        self.engine_class = mutant.engine_class

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        if self.mutant.graphs is not None and cfg.graph_executor is None:
            cfg = replace(cfg, graph_executor=self.mutant.graphs)
        return super().open(cfg)


def mutant_backend(name: str) -> MutantBackend:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})")
    return MutantBackend(MUTANTS[name])
