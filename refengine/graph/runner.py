"""GraphRunner: target decode and verify forwards, and whole draft steps, replayed on static,
bucket-padded buffers.

It wraps a ``ModelRunner`` and implements the same ``Runner`` protocol: the ``prepare_*``
methods build every batch through the wrapped runner and tag decode/verify batches with what
staging needs (request rows, lengths, tree mask), their eager attention metadata built only if
an eager forward reads it (``LazyAttention``); ``forward`` stages a batch it has a bucket for,
runs the executor on the target's static forward (``TargetForward``: a replay builds its
own batch over the staged views, its attention derived from them), and slices the real rows
back out; anything else falls back to the wrapped runner's eager forward. With a draft model,
``draft_loop`` (``draft_loop.py``) replays a whole draft step on the same buckets and key
widths, on a sibling of the target's executor; the workers call it before their eager
forwards. A greedy chain step also has ``spec_step`` (``step_graph.py``): draft, verify, walk
(and EAGLE's draft-extend) as one graph. Everything else (draft prefill and draft-extend forwards,
``kv``, ``target``) is the wrapped runner's, each method delegated by name.

Key width: every key fixes ``max_kv``, the number of key columns each request's attention
gathers and masks, so the shapes of a replay never depend on the requests' lengths. A batch
uses the narrowest of ``kv_sizes`` that holds its longest request; the widest is the row
table's (the longest context a request can reach, verify head-room included), so no
decode/verify batch is refused for its length. One width only (the table's) would be simplest,
but attention work follows the width, not the real lengths, hence a doubling ladder from 256
columns by default (``kv_widths``); each width is one more key per bucket to capture or
compile, so a compiled deployment should list only the widths it needs.

Not thread-safe: one set of static buffers per kind, so forwards must not run concurrently
(the engine launches one step at a time, also on its overlap thread).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from refengine.device import from_host
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.executors import make_executor
from refengine.graph.program import Executor
from refengine.graph.staging import (
    StagedViews,
    Staging,
    StepInputs,
    capture_sizes,
    check_sizes,
    kv_widths,
    pad_to_bucket,
)
from refengine.graph.step_graph import StepGraph
from refengine.graph.target import GraphKey, TargetForward
from refengine.memory.manager import KVManager
from refengine.model.eagle3 import EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
from refengine.request import Req
from refengine.runner import DraftNet, ModelRunner
from refengine.speculative.inputs import DraftExtendInput, VerifyInput

TargetExecutor = Executor[GraphKey, StagedViews, ForwardOutput]


@dataclass
class GraphBatch(ForwardBatch):
    """A ``ForwardBatch`` that also says, per request, which row and how many positions it
    has, and its tree mask (None: causal) -- what staging needs and the flat batch lost. The
    lengths come twice: on the device for staging, on the host (``host_seq_lens``) for
    choosing the key, which must not wait for the device."""

    rows: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    host_seq_lens: list[int] | None = None

    @classmethod
    def tag(cls, batch: ForwardBatch, rows: list[int], seq_lens: list[int],
            tree_mask: torch.Tensor | None = None) -> GraphBatch:
        packed = from_host([rows, seq_lens], batch.input_ids.device)  # one copy for both
        return cls(**{f.name: getattr(batch, f.name) for f in fields(ForwardBatch)},
                   rows=packed[0], seq_lens=packed[1], tree_mask=tree_mask,
                   host_seq_lens=seq_lens)


class GraphRunner:
    """``forward(batch)``: stage -> execute -> slice for decode (1 token per request) and
    verify (``verify_tokens`` per request) batches of up to ``max_bs`` requests; the wrapped
    runner's eager forward otherwise. It is a ``Runner``: what it does not replay it hands to
    the wrapped runner, method by method."""

    staging_class: type[Staging] = Staging  # the bug zoo swaps in a broken padding
    draft_loop_class: type[DraftLoopGraph] = DraftLoopGraph  # ... or a broken draft loop
    target_forward_class: type[TargetForward] = TargetForward  # ... or a broken verify walk
    step_graph_class: type[StepGraph] = StepGraph  # ... or a broken one-graph step

    def __init__(self, runner: ModelRunner, executor: str | TargetExecutor = "replay",
                 max_bs: int | None = None, verify_tokens: int | None = None,
                 sizes: Sequence[int] | None = None, kv_sizes: Sequence[int] | None = None,
                 draft_steps: tuple[int, int] | None = None) -> None:
        """``executor``: a registry name (``refengine.graph.executors``) or an executor of
        ``TargetForward(runner)``; the draft loops run on its siblings."""
        self.runner = runner
        table = runner.kv.rows.table
        self.sizes = check_sizes(list(sizes) if sizes is not None
                                 else capture_sizes(max_bs or runner.kv.rows.usable_rows))
        width = table.shape[1]
        self.kv_sizes = check_sizes(list(kv_sizes) if kv_sizes is not None
                                    else kv_widths(width))
        if self.kv_sizes[-1] > width:
            raise ValueError(f"kv_sizes: {self.kv_sizes[-1]} key columns exceed the row table "
                             f"width {width}")
        # Kind -> tokens per request. N == 1 would be a decode batch, so no separate kind.
        self.kinds = {"decode": 1}
        if verify_tokens is not None and verify_tokens > 1:
            self.kinds["verify"] = verify_tokens
        self.staging = {kind: self.staging_class(self.sizes[-1], q, table.device)
                        for kind, q in self.kinds.items()}
        # A verify key walks its trees inside the graph (greedy accept on the device), to
        # the speculative steps' depth.
        walk_depth = None if draft_steps is None or "verify" not in self.kinds else draft_steps[1]
        self.program = self.target_forward_class(runner, walk_depth)
        self.executor = (self.executor_for(executor) if isinstance(executor, str)
                         else executor)
        # The whole draft step as one graph, for a runner with a draft model (``draft_steps``
        # is (topk, num_steps)), and an EAGLE head's draft-extend (N rows per request, the
        # verify width). A standalone draft model drafts forward by forward.
        self._draft_loop: DraftLoopGraph | None = None
        self._draft_extend: DraftLoopGraph | None = None
        self._spec_step: StepGraph | None = None
        draft = runner.draft
        if draft_steps is not None and isinstance(draft, EagleHead | FrozenKVMTPDraftModel):
            eagle = isinstance(draft, EagleHead)
            pool = runner.kv.draft_pool if eagle else runner.kv.target_pool
            assert pool is not None, "an EAGLE head keeps draft KV"
            self._draft_loop = self.draft_loop_class(
                draft, pool, table, *draft_steps, self.sizes, self.kv_sizes, self.executor)
            if eagle and "verify" in self.kinds:
                self._draft_extend = self.draft_loop_class(
                    draft, pool, table, *draft_steps, self.sizes, self.kv_sizes, self.executor,
                    extend_rows=self.kinds["verify"])
            # A greedy chain step as one graph (draft, verify, walk, EAGLE's draft-extend).
            if draft_steps[0] == 1 and "verify" in self.kinds:
                self._spec_step = self.step_graph_class(
                    runner.target, draft, runner.kv.target_pool, runner.kv.draft_pool, table,
                    draft_steps[1], self.sizes, self.kv_sizes, self.executor)

    def executor_for(self, name: str) -> TargetExecutor:
        """The registry's executor ``name`` for the target's forward (ValueError for a name
        not in it, or "cuda" off a CUDA device); an extension point (the tests' emulated CUDA
        graphs)."""
        return make_executor(name, self.program, str(self.runner.kv.rows.table.device))

    # --- the Runner surface: the wrapped runner's parts and its eager batches ------------------

    @property
    def target(self) -> LlamaForCausalLM:
        return self.runner.target

    @property
    def draft(self) -> DraftNet | None:
        return self.runner.draft

    @property
    def kv(self) -> KVManager:
        return self.runner.kv

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def draft_loop(self) -> DraftLoopGraph | None:
        return self._draft_loop

    @property
    def draft_extend(self) -> DraftLoopGraph | None:
        return self._draft_extend

    @property
    def spec_step(self) -> StepGraph | None:
        """The whole greedy chain step (EAGLE, Frozen-KV MTP) as one graph
        (``step_graph.py``), or None."""
        return self._spec_step

    def prepare_score(self, req: Req, ids: list[int], slots: torch.Tensor, last_only: bool
                      ) -> ForwardBatch:
        return self.runner.prepare_score(req, ids, slots, last_only)

    def prepare_draft_prefill(self, target_batch: ForwardBatch, next_ids: torch.Tensor,
                              last_rows: torch.Tensor) -> ForwardBatch:
        return self.runner.prepare_draft_prefill(target_batch, next_ids, last_rows)

    def prepare_draft_step(self, reqs: list[Req], tokens: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, width: int, seen: list[int],
                           masks: list[torch.Tensor] | None = None) -> ForwardBatch:
        return self.runner.prepare_draft_step(reqs, tokens, positions, slots, width, seen, masks)

    def prepare_draft_extend(self, reqs: list[Req], accepted: DraftExtendInput, ends: list[int]
                             ) -> ForwardBatch:
        return self.runner.prepare_draft_extend(reqs, accepted, ends)

    def prepare_tail(self, reqs: list[Req], ids: torch.Tensor, lens: list[int],
                     ends: list[int]) -> ForwardBatch:
        return self.runner.prepare_tail(reqs, ids, lens, ends)

    def forward_draft(self, batch: ForwardBatch, features: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.forward_draft(batch, features)

    def forward_draft_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.forward_draft_model(batch)

    def prepare_frozen_draft(self, reqs: list[Req], seq_lens: list[int], width: int
                             ) -> ForwardBatch:
        return self.runner.prepare_frozen_draft(reqs, seq_lens, width)

    def forward_frozen_draft(self, batch: ForwardBatch, tokens: torch.Tensor,
                             hidden: torch.Tensor, rows: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.forward_frozen_draft(batch, tokens, hidden, rows)

    # --- batches ----------------------------------------------------------------------------

    def prepare_extend(self, reqs: list[Req], lens: list[int], ids: list[int],
                       sample_at: list[int]) -> ForwardBatch:
        starts = [r.kv_committed_len for r in reqs]  # before the wrapped runner extends
        batch = self.runner.prepare_extend(reqs, lens, ids, sample_at, lazy_attention=True)
        return GraphBatch.tag(batch, [r.row for r in reqs],
                              [s + n for s, n in zip(starts, lens, strict=True)])

    def prepare_verify(self, reqs: list[Req], verify_input: VerifyInput, slots: torch.Tensor,
                       causal: bool) -> ForwardBatch:
        batch = self.runner.prepare_verify(reqs, verify_input, slots, causal,
                                           lazy_attention=True)
        n = verify_input.draft_tokens.shape[1]
        return GraphBatch.tag(batch, [r.row for r in reqs],
                              [root + n for root in verify_input.root_positions()],
                              None if causal else verify_input.tree_mask)

    # --- forward ----------------------------------------------------------------------------

    def graph_key(self, batch: ForwardBatch) -> GraphKey | None:
        """The key ``batch`` replays on, or None (eager): a tagged batch whose requests all
        bring the same number of tokens, a kind with that many, at most the largest bucket of
        requests, and no request longer than the widest key width."""
        if not isinstance(batch, GraphBatch) or batch.rows is None or not batch.host_seq_lens:
            return None
        raw = int(batch.rows.shape[0])
        if raw == 0 or batch.attention.ragged is not None or raw > self.sizes[-1]:
            return None  # ragged (a prefill mix) or too many requests
        q, rest = divmod(int(batch.input_ids.shape[0]), raw)
        kind = next((k for k, n in self.kinds.items() if n == q), None)
        if rest or kind is None:
            return None
        longest = max(batch.host_seq_lens)
        if longest > self.kv_sizes[-1]:
            return None
        return GraphKey(kind, pad_to_bucket(raw, self.sizes),
                        self.kv_sizes[bisect.bisect_left(self.kv_sizes, longest)])

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.graph_key(batch) is not None

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        key = self.graph_key(batch)
        if key is None:
            return self.runner.forward(batch)
        assert isinstance(batch, GraphBatch) and batch.rows is not None
        assert batch.seq_lens is not None
        raw = int(batch.rows.shape[0])
        step = StepInputs(batch.input_ids, batch.positions, batch.out_slots, batch.rows,
                          batch.seq_lens, batch.tree_mask)
        label = (f"graph[{key.kind} raw={raw} bucket={key.bucket} kv={key.max_kv} "
                 f"{self.executor.name}]")
        with torch.profiler.record_function(label):
            views = self.staging[key.kind].stage(step, key.bucket)
            out = self.executor.run(key, views)
            tokens = raw * views.q
            logits, features = out.logits[:tokens], out.features[:tokens]
            walk = None if out.walk is None else out.walk[:raw]
            if self.executor.outputs_persist:
                # The next run overwrites them: hand out copies, never the executor's memory.
                logits, features = logits.clone(), features.clone()
                walk = None if walk is None else walk.clone()
            if batch.logits_index is not None:
                logits = logits.index_select(0, batch.logits_index)
        return ForwardOutput(logits, features, walk)

    def capture_pending(self) -> None:
        """Prepare the keys a launch thread needed first (it ran them eagerly: a CUDA-graph
        capture there would race the resolving thread's CUDA work), each on a batch of padding.
        The engine calls it on its own thread before a launch, while nothing else runs."""
        for key in self.executor.pending():
            self.executor.prepare(key, self.staging[key.kind].stage(None, key.bucket))
        for loop in (self._draft_loop, self._draft_extend, self._spec_step):
            if loop is not None:
                loop.capture_pending()

    def capture(self, kinds: Sequence[str] | None = None, sizes: Sequence[int] | None = None,
                kv_sizes: Sequence[int] | None = None) -> dict[GraphKey, float]:
        """Capture or compile keys ahead of serving, each on a batch of padding only (which
        writes nothing but the dummy page); -> seconds per key."""
        seconds: dict[GraphKey, float] = {}
        for kind in kinds or list(self.kinds):
            for bucket in sizes or self.sizes:
                for max_kv in kv_sizes or self.kv_sizes:
                    key = GraphKey(kind, bucket, max_kv)
                    start = time.perf_counter()
                    self.executor.prepare(key, self.staging[kind].stage(None, bucket))
                    seconds[key] = time.perf_counter() - start
        return seconds
