"""ModelRunner: builds the eager engine's ``ForwardBatch``/``AttentionMetadata`` and calls its
target and draft models.

Callers say *what* runs (which requests, which tokens at which positions, which KV slots); the
runner says *how*: flat batches in request order, attention metadata over the row table, which
rows' logits are wanted. It reads the KV bookkeeping and never changes it: the slots a forward
writes were allocated at schedule time. In the engine and its speculative workers every batch
comes from here; the graph runner (``refengine/graph``) wraps this class and builds the padded
batches its captured graphs replay (its staging and draft loop make their own).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from refengine.device import from_host
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata, LazyAttention
from refengine.model.eagle import EagleDraftModel
from refengine.model.eagle3 import Eagle3DraftModel, EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
from refengine.model.standalone_draft import StandaloneDraftModel
from refengine.request import Req
from refengine.speculative.inputs import DraftExtendInput, VerifyInput

if TYPE_CHECKING:
    from refengine.graph.draft_loop import DraftLoopGraph
    from refengine.graph.step_graph import StepGraph

DraftNet = EagleDraftModel | Eagle3DraftModel | FrozenKVMTPDraftModel | StandaloneDraftModel


class Runner(Protocol):
    """What the engine and its speculative workers call on a runner: its parts, the batches it
    builds, the forwards it runs and the draft graphs it replays. ``ModelRunner`` is the eager
    one; ``GraphRunner`` (``refengine/graph/runner.py``) wraps one and replays the target's
    decode and verify forwards and whole draft steps on graphs."""

    @property
    def target(self) -> LlamaForCausalLM: ...
    @property
    def draft(self) -> DraftNet | None: ...
    @property
    def kv(self) -> KVManager: ...
    @property
    def device(self) -> torch.device: ...

    @property
    def draft_loop(self) -> DraftLoopGraph | None:
        """The graph that replays a whole draft step; None: the worker drafts forward by
        forward."""

    @property
    def draft_extend(self) -> DraftLoopGraph | None:
        """The graph that replays an EAGLE draft-extend; None: it runs eagerly."""

    @property
    def spec_step(self) -> StepGraph | None:
        """The graph that replays a whole greedy chain step (draft, verify, walk, EAGLE's
        draft-extend); None: the worker runs the phases apart."""

    def capture_pending(self) -> None:
        """Capture the graphs a launch thread needed first (on the engine's thread)."""

    def prepare_extend(self, reqs: list[Req], lens: list[int], ids: list[int],
                       sample_at: list[int]) -> ForwardBatch: ...
    def prepare_score(self, req: Req, ids: list[int], slots: torch.Tensor, last_only: bool
                      ) -> ForwardBatch: ...
    def prepare_verify(self, reqs: list[Req], verify_input: VerifyInput, slots: torch.Tensor,
                       causal: bool) -> ForwardBatch: ...
    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...
    def prepare_draft_prefill(self, target_batch: ForwardBatch, next_ids: torch.Tensor,
                              last_rows: torch.Tensor) -> ForwardBatch: ...
    def prepare_draft_step(self, reqs: list[Req], tokens: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, width: int, seen: list[int],
                           masks: list[torch.Tensor] | None = None) -> ForwardBatch: ...
    def prepare_draft_extend(self, reqs: list[Req], accepted: DraftExtendInput, ends: list[int]
                             ) -> ForwardBatch: ...
    def prepare_tail(self, reqs: list[Req], ids: torch.Tensor, lens: list[int],
                     ends: list[int]) -> ForwardBatch: ...
    def forward_draft(self, batch: ForwardBatch, features: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def forward_draft_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def prepare_frozen_draft(self, reqs: list[Req], seq_lens: list[int], width: int
                             ) -> ForwardBatch: ...
    def forward_frozen_draft(self, batch: ForwardBatch, tokens: torch.Tensor,
                             hidden: torch.Tensor, rows: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ModelRunner:
    """The eager ``Runner``: every forward runs the models directly; it replays no graphs."""

    def __init__(self, target: LlamaForCausalLM, draft: DraftNet | None, kv: KVManager) -> None:
        self.target = target
        self.draft = draft
        self.kv = kv
        # The eager runner replays no draft step and no draft-extend: the workers draft and
        # extend forward by forward.
        self.draft_loop: DraftLoopGraph | None = None
        self.draft_extend: DraftLoopGraph | None = None
        self.spec_step: StepGraph | None = None

    @property
    def device(self) -> torch.device:
        """The engine's device: every tensor a forward reads is made there."""
        return self.kv.device

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """Host integers as one int64 tensor on the device (one copy, not one per element)."""
        return from_host(values, self.device)

    def capture_pending(self) -> None:
        """The eager runner records no graphs, so none waits for capture."""

    def attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                           seq_lens: list[int], masks: list[torch.Tensor] | None = None
                           ) -> AttentionMetadata:
        return AttentionMetadata.build(self.kv.rows.table, rows, extend_lens, seq_lens, masks)

    def _rows(self, reqs: list[Req]) -> torch.Tensor:
        return self._tensor([r.row for r in reqs])

    # --- target ---------------------------------------------------------------------------

    def prepare_extend(self, reqs: list[Req], lens: list[int], ids: list[int],
                       sample_at: list[int], lazy_attention: bool = False) -> ForwardBatch:
        """A prefill chunk or a plain decode step: request i runs its next ``lens[i]`` tokens
        (its slice of ``ids``) from its committed end, into the slots the scheduler allocated
        for them; logits are wanted at the flat rows ``sample_at``. ``lazy_attention``: a
        uniform batch's metadata is built on first use (``LazyAttention``; the graph runner's
        batches)."""
        starts = [r.kv_committed_len for r in reqs]
        ends = [s + n for s, n in zip(starts, lens, strict=True)]
        return ForwardBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor([p for s, n in zip(starts, lens, strict=True)
                                    for p in range(s, s + n)]),
            out_slots=self.kv.run_slots(reqs, starts, lens),
            attention=self._attention(
                lambda: self.attention_metadata(self._rows(reqs), lens, ends),
                lazy_attention and len(set(lens)) == 1),
            logits_index=self._tensor(sample_at))

    def prepare_score(self, req: Req, ids: list[int], slots: torch.Tensor, last_only: bool
                      ) -> ForwardBatch:
        """A whole prompt into ``slots`` for a request that holds nothing else (scoring)."""
        n = len(ids)
        return ForwardBatch(self._tensor(ids), torch.arange(n, device=self.device), slots,
                            self.attention_metadata(self._rows([req]), [n], [n]),
                            self._tensor([n - 1]) if last_only else None)

    def prepare_verify(self, reqs: list[Req], verify_input: VerifyInput, slots: torch.Tensor,
                       causal: bool, lazy_attention: bool = False) -> ForwardBatch:
        """The verify block: request i's ``N`` nodes at positions ``root + depth`` writing the
        slots ``slots[i]``; a chain's tree mask is causal, the metadata's default.
        ``lazy_attention`` as for ``prepare_extend`` (a verify batch is always uniform)."""
        b, n = verify_input.draft_tokens.shape
        roots = verify_input.root_positions()
        meta = self._attention(
            lambda: self.attention_metadata(self._rows(reqs), [n] * b, [s + n for s in roots],
                                            None if causal else list(verify_input.tree_mask)),
            lazy_attention)
        return ForwardBatch(verify_input.draft_tokens.reshape(-1),
                            verify_input.positions.reshape(-1), slots.reshape(-1), meta)

    @staticmethod
    def _attention(build: Callable[[], AttentionMetadata], lazy: bool) -> AttentionMetadata:
        return LazyAttention(build) if lazy else build()

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return self.target(batch, self.kv.target_pool)

    # --- draft ----------------------------------------------------------------------------

    def prepare_draft_prefill(self, target_batch: ForwardBatch, next_ids: torch.Tensor,
                              last_rows: torch.Tensor) -> ForwardBatch:
        """A draft over a target prefill batch: same positions, slots and attention, tokens
        ``next_ids`` (EAGLE's head: each position paired with the token after it; a standalone
        draft model: the batch's own); ``last_rows`` are the rows to predict from."""
        return ForwardBatch(next_ids, target_batch.positions, target_batch.out_slots,
                            target_batch.attention, last_rows)

    def prepare_draft_step(self, reqs: list[Req], tokens: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, width: int, seen: list[int],
                           masks: list[torch.Tensor] | None = None) -> ForwardBatch:
        """One drafting forward: ``width`` nodes per request, attending to ``seen[i]`` KV
        positions (the committed prefix and the draft's scratch so far); ``masks`` restrict
        the scratch part to each node's ancestors (None: causal)."""
        meta = self.attention_metadata(self._rows(reqs), [width] * len(reqs), seen, masks)
        return ForwardBatch(tokens, positions, slots, meta)

    def prepare_draft_extend(self, reqs: list[Req], accepted: DraftExtendInput, ends: list[int]
                             ) -> ForwardBatch:
        """The head over each request's accepted positions, which end before ``ends[i]``."""
        return self.prepare_tail(reqs, accepted.input_ids, accepted.host_lens(), ends)

    def prepare_tail(self, reqs: list[Req], ids: torch.Tensor, lens: list[int],
                     ends: list[int]) -> ForwardBatch:
        """Request i's ``lens[i]`` positions ending before ``ends[i]`` (their slots already in
        its row; ``ids`` flat, in request order); logits at each request's last position."""
        rows = [r.row for r in reqs]
        positions = self._tensor([p for e, n in zip(ends, lens, strict=True)
                                  for p in range(e - n, e)])
        slots = self.kv.rows.table[self._tensor([r for r, n in zip(rows, lens, strict=True)
                                                 for _ in range(n)]), positions]
        last = self._tensor([end - 1 for end in itertools.accumulate(lens)])
        meta = self.attention_metadata(self._tensor(rows), lens, ends)
        return ForwardBatch(ids, positions, slots, meta, last)

    def forward_draft(self, batch: ForwardBatch, features: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits of the wanted rows, the head's predicted features)."""
        assert isinstance(self.draft, EagleHead) and self.kv.draft_pool is not None
        return self.draft(batch, features, self.kv.draft_pool)

    def forward_draft_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A standalone draft model over ``batch``, writing its own KV -> (logits of the
        wanted rows, its final-norm features at them)."""
        assert isinstance(self.draft, StandaloneDraftModel) and self.kv.draft_pool is not None
        out = self.draft(batch, self.kv.draft_pool)
        return out.logits, batch.wanted(out.features)

    # --- a frozen-KV draft (it reads the target's KV and writes none) --------------------------

    def prepare_frozen_draft(self, reqs: list[Req], seq_lens: list[int], width: int
                             ) -> ForwardBatch:
        """``width`` rows per request, each a query at ``max(seq_len - 1, 0)`` that sees the
        committed prefix ``[0, seq_len)`` of the target's KV. There are no slots (nothing is
        written) and the tokens come with each forward (``input_ids`` holds placeholders)."""
        lens = [s for s in seq_lens for _ in range(width)]
        meta = self.attention_metadata(self._rows(reqs).repeat_interleave(width),
                                       [1] * len(lens), lens)
        return ForwardBatch(torch.zeros(len(lens), dtype=torch.int64, device=self.device),
                            self._tensor([max(s - 1, 0) for s in lens]),
                            torch.empty((0,), dtype=torch.int64, device=self.device), meta)

    def forward_frozen_draft(self, batch: ForwardBatch, tokens: torch.Tensor,
                             hidden: torch.Tensor, rows: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, next recurrent vectors) for every row of ``batch`` or the ``rows``."""
        assert isinstance(self.draft, FrozenKVMTPDraftModel)
        positions, meta = batch.positions, batch.attention
        if rows is not None:
            positions, meta = positions.index_select(0, rows), meta.at_queries(rows)
        return self.draft(tokens, hidden, positions, meta, self.kv.target_pool)
