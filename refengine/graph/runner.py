"""GraphRunner: target decode and verify forwards, and whole draft steps, replayed on static,
bucket-padded buffers.

It wraps a ``ModelRunner`` and offers the same surface: the ``prepare_*`` methods build every
batch through the wrapped runner and tag decode/verify batches with what staging needs
(request rows, lengths, tree mask); a replay builds its own batch over the staged views
(``static_forward``), its attention derived from them (``static_attention``);
``forward`` stages a batch it has a bucket for, runs the executor, and slices the real rows
back out; anything else falls back to the wrapped runner's eager forward. With a draft model,
``draft_loop`` (``draft_loop.py``) replays a whole draft step on the same buckets and key
widths; the workers call it before their eager forwards. Everything else (draft prefill and
draft-extend forwards, ``kv``, ``target``) is the wrapped runner's.

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
from typing import Any

import torch

from refengine.device import from_host
from refengine.graph.aot import AotExecutor
from refengine.graph.cuda_graph import CudaGraphExecutor, CudaGraphs
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.executors import (
    CompiledExecutor,
    Executor,
    GraphKey,
    ReplayExecutor,
)
from refengine.graph.staging import (
    StagedViews,
    Staging,
    StepInputs,
    capture_sizes,
    check_sizes,
    kv_widths,
    pad_to_bucket,
    static_attention,
)
from refengine.model.eagle import EagleDraftModel
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import ForwardBatch, ForwardOutput
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.inputs import VerifyInput


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
        device = batch.input_ids.device
        return cls(**{f.name: getattr(batch, f.name) for f in fields(ForwardBatch)},
                   rows=from_host(rows, device), seq_lens=from_host(seq_lens, device),
                   tree_mask=tree_mask, host_seq_lens=seq_lens)


class GraphRunner:
    """``forward(batch)``: stage -> execute -> slice for decode (1 token per request) and
    verify (``verify_tokens`` per request) batches of up to ``max_bs`` requests; the wrapped
    runner's eager forward otherwise."""

    staging_class: type[Staging] = Staging  # the bug zoo swaps in a broken padding
    draft_loop_class: type[DraftLoopGraph] = DraftLoopGraph  # ... or a broken draft loop

    def __init__(self, runner: ModelRunner, executor: str | Executor = "replay",
                 max_bs: int | None = None, verify_tokens: int | None = None,
                 sizes: Sequence[int] | None = None, kv_sizes: Sequence[int] | None = None,
                 draft_steps: tuple[int, int] | None = None) -> None:
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
        device = table.device
        self.staging = {kind: self.staging_class(self.sizes[-1], q, device)
                        for kind, q in self.kinds.items()}
        self.executor = (self._make_executor(executor) if isinstance(executor, str)
                         else executor)
        # The whole draft step as one graph, for a runner with a draft model: ``draft_steps``
        # is (topk, num_steps). Its executor is the target's ("compiled-layers": "compiled").
        self.draft_loop: DraftLoopGraph | None = None
        # An EAGLE head's draft-extend as a graph too (N rows per request, the verify width).
        self.draft_extend: DraftLoopGraph | None = None
        draft = runner.draft
        # A standalone draft model drafts forward by forward (no loop graph of its kind).
        if draft_steps is not None and isinstance(draft, (EagleDraftModel, FrozenKVMTPDraftModel)):
            pool = (runner.kv.draft_pool if isinstance(draft, EagleDraftModel)
                    else runner.kv.target_pool)
            assert pool is not None, "an EAGLE head keeps draft KV"
            loop_executor = (self.executor.name
                             if self.executor.name in ("replay", "frozen", "cuda", "aot")
                             else "compiled")
            # CUDA graphs: the loops record into the target's pool (one pool per runner).
            recorder = (self.executor.graphs if isinstance(self.executor, CudaGraphExecutor)
                        else None)
            packages = (self.executor.packages.cache if isinstance(self.executor, AotExecutor)
                        else None)
            self.draft_loop = self.draft_loop_class(
                draft, pool, table, *draft_steps, self.sizes, self.kv_sizes, loop_executor,
                recorder=recorder, packages=packages)
            if isinstance(draft, EagleDraftModel) and "verify" in self.kinds:
                self.draft_extend = self.draft_loop_class(
                    draft, pool, table, *draft_steps, self.sizes, self.kv_sizes, loop_executor,
                    extend_rows=self.kinds["verify"], recorder=recorder, packages=packages)

    def _make_executor(self, name: str) -> Executor:
        if name == "replay":
            return ReplayExecutor(self.static_forward)
        if name in ("compiled", "compiled-layers", "frozen"):
            return CompiledExecutor(self.runner.target, self.runner.kv.target_pool,
                                    self.runner.kv.rows.table,
                                    split="layers" if name == "compiled-layers" else "whole",
                                    freeze_weights=name == "frozen")
        if name == "aot":  # persistent packages (refengine/graph/aot.py)
            return AotExecutor(self.runner.target, self.runner.kv.target_pool,
                               self.runner.kv.rows.table)
        if name == "cuda":  # real graphs on a CUDA device; ValueError elsewhere
            return CudaGraphExecutor(self.static_forward,
                                     CudaGraphs(self.runner.kv.rows.table.device))
        raise ValueError(f"executor: 'replay', 'compiled', 'compiled-layers', 'frozen', 'cuda' "
                         f"or 'aot', got {name!r}")

    def static_forward(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        """The captured callable: the model's own forward over the padded static views."""
        attention = static_attention(views.rows, views.seq_lens, views.tree_mask,
                                     self.runner.kv.rows.table, key.max_kv)
        return self.runner.forward(ForwardBatch(views.input_ids, views.positions,
                                                views.out_slots, attention))

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class lacks: the draft side, kv, target, ... ("runner"
        # itself is refused, or a half-built instance would recurse forever).
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    # --- batches ----------------------------------------------------------------------------

    def prepare_extend(self, reqs: list[Req], lens: list[int], ids: list[int],
                       sample_at: list[int]) -> ForwardBatch:
        starts = [r.kv_committed_len for r in reqs]  # before the wrapped runner extends
        batch = self.runner.prepare_extend(reqs, lens, ids, sample_at)
        return GraphBatch.tag(batch, [r.row for r in reqs],
                              [s + n for s, n in zip(starts, lens, strict=True)])

    def prepare_verify(self, reqs: list[Req], verify_input: VerifyInput, slots: torch.Tensor,
                       causal: bool) -> ForwardBatch:
        batch = self.runner.prepare_verify(reqs, verify_input, slots, causal)
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
            if self.executor.outputs_persist:
                # The next run overwrites them: hand out copies, never the executor's memory.
                logits, features = logits.clone(), features.clone()
            if batch.logits_index is not None:
                logits = logits.index_select(0, batch.logits_index)
        return ForwardOutput(logits, features)

    def capture_pending(self) -> None:
        """Capture the CUDA-graph keys a launch thread needed first (it ran them eagerly: a
        capture there would race the resolving thread's CUDA work), each on a batch of padding.
        The engine calls it on its own thread before a launch, while nothing else runs."""
        executor = self.executor
        if not isinstance(executor, CudaGraphExecutor) or not executor.graphs.may_capture():
            return
        for key in sorted(executor.keyed.pending):
            executor.prepare(key, self.staging[key.kind].stage(None, key.bucket))
        for loop in (self.draft_loop, self.draft_extend):
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
