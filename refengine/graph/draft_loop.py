"""The draft loop as one graph: a whole draft step (every forward, the top-k and the beam
bookkeeping, ``loops.py``) replayed on static, bucket-padded buffers (``loop_staging.py``) by
the target's executor kind, for batches whose requests fit a bucket and a key width.

Padding: every padded row reads and writes only the reserved dummy row/slot and computes
finite values (``LOOP_FIELDS`` says why for each buffer).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from refengine.graph.loop_staging import LoopStaging
from refengine.graph.loops import GraphOutput, LoopKey, LoopProgram, LoopViews
from refengine.graph.program import Executor, Program, copy_out
from refengine.graph.staging import DUMMY_SLOT, pad_to_bucket
from refengine.memory.kv_pool import KVPool
from refengine.model.eagle3 import EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.speculative.draft_search import Candidates
from refengine.speculative.inputs import DraftExtendInput


def _slice(out: Any, raw: int) -> Any:
    """The real requests' rows of a loop's output (a tensor, a tuple of them, ``Candidates``)."""
    if isinstance(out, Candidates):
        return Candidates(out.scores[:raw], out.tokens[:raw], out.parents[:raw])
    if isinstance(out, tuple):
        return tuple(t[:raw] for t in out)
    return out[:raw]


def feature_shape(draft: EagleHead | FrozenKVMTPDraftModel) -> tuple[int, torch.dtype]:
    """The width and dtype of the features a draft step carries: an EAGLE head's own, the
    target's for Frozen-KV MTP."""
    if isinstance(draft, EagleHead):
        return draft.config.hidden_size, draft.fc.weight.dtype
    return draft.config.target_hidden_size, draft.pre_projection.weight.dtype


class DraftLoopGraph:
    """``run(inputs)``: stage -> execute -> slice a whole draft step, for batches of up to the
    largest bucket whose longest request fits the widest key width; None otherwise (the worker
    then drafts eagerly).

    The loop runs on a sibling of the target's executor (``Executor.sibling``): "replay" calls
    it on the static views, "compiled" and "frozen" compile it per key, "cuda" captures it per
    key into the target's graph pool, "aot" calls a persistent package per key kept in the
    target's cache (``package_settings`` pick the GEMM kernels by the key's rows)."""

    staging_class: type[LoopStaging] = LoopStaging  # the bug zoo swaps in a broken restaging

    def __init__(self, draft: EagleHead | FrozenKVMTPDraftModel, pool: KVPool,
                 table: torch.Tensor, topk: int, steps: int, sizes: Sequence[int],
                 kv_sizes: Sequence[int], executor: Executor[Any, Any, Any],
                 extend_rows: int = 0) -> None:
        """``executor``: the target's, whose sibling runs the loop. ``extend_rows`` > 0 (an
        EAGLE head): the graph of the head's draft-extend over that many rows per request
        ("extend:eagle") instead of the draft loop."""
        eagle = isinstance(draft, EagleHead)
        if extend_rows and not eagle:
            raise ValueError("an extend graph needs an EAGLE head")
        kind = ("extend:eagle" if extend_rows else "draft:eagle") if eagle else "draft:mtp"
        self.bind(kind, draft, table, topk, steps, sizes, kv_sizes, {
            "k": topk, "scratch": topk * (steps - 1), "N": extend_rows},
            lambda fields: LoopProgram(kind, draft, pool, table, topk, steps, fields,
                                       extend_rows or topk), executor)

    def bind(self, kind: str, draft: EagleHead | FrozenKVMTPDraftModel, table: torch.Tensor,
             topk: int, steps: int, sizes: Sequence[int], kv_sizes: Sequence[int],
             dims: dict[str, int], program: Callable[[list[str]], Program[Any, Any, Any]],
             executor: Executor[Any, Any, Any]) -> None:
        """What every loop graph holds: its kind, buckets and key widths, its static buffers
        (``dims`` per-request sizes by name; the features' ``H`` and dtype are the draft's),
        the program built over those buffers' fields and a sibling of ``executor`` for it."""
        self.kind, self.table, self.topk, self.steps = kind, table, topk, steps
        self.sizes, self.kv_sizes = list(sizes), list(kv_sizes)
        hidden, dtype = feature_shape(draft)
        self.staging = self.staging_class(kind, self.sizes[-1], {**dims, "H": hidden}, dtype,
                                          table.device)
        self.program = program(list(self.staging.fields))
        self.executor: Executor[LoopKey, LoopViews, Any] = executor.sibling(self.program)

    def key(self, raw: int, longest: int) -> LoopKey | None:
        """(bucket, key width) for ``raw`` requests whose longest committed length (EAGLE's
        roots, MTP's sequence lengths; read on the host, so choosing a key never waits for the
        device) is ``longest``, or None: no request, too many, or one too long for the widest
        key (EAGLE's scratch lies past its root)."""
        if raw == 0 or raw > self.sizes[-1]:
            return None
        longest += self.reach()
        if longest > self.kv_sizes[-1]:
            return None
        return (pad_to_bucket(raw, self.sizes),
                self.kv_sizes[bisect.bisect_left(self.kv_sizes, longest)])

    def reach(self) -> int:
        """Key columns past a request's committed length that the loop's attention spans:
        EAGLE's scratch lies past its root; MTP reads the prefix only, an extend ends at it."""
        return self.topk * (self.steps - 1) if self.kind == "draft:eagle" else 0

    def run(self, inputs: dict[str, torch.Tensor], longest: int) -> Any:
        """The step of ``inputs`` (every field of ``LOOP_FIELDS[kind]``); ``longest``: the
        largest of its lengths field, from the host."""
        raw = int(inputs["rows"].shape[0])
        key = self.key(raw, longest)
        if key is None:
            return None
        bucket, max_kv = key
        with torch.profiler.record_function(
                f"graph[{self.kind} raw={raw} bucket={bucket} kv={max_kv} {self.executor.name}]"):
            out = _slice(self.execute(key, self.staging.stage(inputs, bucket)), raw)
        # A replay's outputs may be overwritten by the next one: hand out copies.
        return copy_out(out) if self.executor.outputs_persist else out

    def extend(self, rows: torch.Tensor, ends: torch.Tensor, longest: int,
               accepted: DraftExtendInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An "extend:eagle" graph run from the eager draft-extend's inputs: request i's
        accepted tokens and features (flat, in request order) end before ``ends[i]``
        (``longest``: the largest, from the host); they are right-aligned in ``N`` columns,
        the front padded (token 0, zero features, the dummy slot). None when the graph does
        not take the batch."""
        assert self.kind == "extend:eagle"
        b, n = rows.shape[0], self.staging.buffers["ids"].shape[1]
        if b == 0 or max(accepted.host_lens()) > n:
            return None
        ids, hidden, accept_lens = accepted.input_ids, accepted.hidden_states, accepted.accept_lens
        # Request i's tokens fill its last a_i columns, in flat (row-major) order; column c
        # sits at position ends_i - n + c, as in ``eagle_extend``.
        columns = torch.arange(n, device=rows.device)
        real = columns >= (n - accept_lens)[:, None]
        padded_ids = ids.new_zeros((b, n)).masked_scatter_(real, ids)
        padded_hidden = hidden.new_zeros((b, n, hidden.shape[-1])).masked_scatter_(
            real[..., None], hidden)
        positions = (ends[:, None] - n + columns).clamp_(min=0)
        slots = self.table[rows[:, None], positions].masked_fill_(~real, DUMMY_SLOT)
        found = self.run({"ids": padded_ids, "hidden": padded_hidden, "rows": rows,
                          "ends": ends, "slots": slots}, longest)
        assert found is None or isinstance(found, tuple)
        return found

    def capture_pending(self) -> None:
        """Capture the keys first needed where the executor could not (a CUDA graph off the
        recorder's thread), each on a batch of padding (which writes only the dummy page)."""
        for key in self.executor.pending():
            self.executor.prepare(key, self.staging.stage(None, key[0]))

    def execute(self, key: LoopKey, views: LoopViews) -> GraphOutput:
        with torch.inference_mode():
            return self.executor.run(key, views)
