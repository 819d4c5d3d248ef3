"""The draft loops as static forwards (a ``Program`` per loop graph): a whole draft step (every
forward, the top-k and the beam bookkeeping) on a key's staged buffers.

Two loops, one per draft kind, and EAGLE's draft-extend:

* ``draft:eagle``: the ``S - 1`` forwards of the EAGLE head from the step's ``DraftInput``;
  each writes the head's KV into the step's scratch slots (staged, one row per request) and
  sees the committed prefix and its ancestors' scratch entries.
* ``draft:mtp``: Frozen-KV MTP with the seed folded in as iteration 0. The graph takes the
  per-request ``bonus_tokens`` and target features as staged buffers and produces the first
  candidates (``topk_p``/``topk_index``) itself, then runs the ``S - 1`` later iterations.
  Every buffer, ``bonus_tokens`` included, is restaged on every replay: a buffer left as it
  was captured would replay an earlier step's tokens (outputs stay lossless, acceptance
  silently drops).
* ``extend:eagle``: the EAGLE head over each request's accepted tokens after verify (the
  draft-extend), right-aligned in ``N`` columns; it writes the head's KV for every row and
  predicts from the last one.

Each forward is the draft model's own ``compute`` (``EagleHead.compute``,
``FrozenKVMTPDraftModel.compute``), its KV written through ``refengine::write_kv``. The loops
end with ``search`` (``refengine/speculative/draft_search.py``: the chain or the beam), the
same search the eager draft runs, so only the forwards differ: here their attention metadata
is derived inside the graph from the staged rows and lengths (``AttentionMetadata.over_blocks``)
at a fixed key width. Tree assembly stays eager, in the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from refengine.graph.compile import InPlaceKV
from refengine.graph.export import open_limits, register_tables
from refengine.graph.program import PackageSpec
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle3 import EagleHead
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.model.llama import KVCache
from refengine.speculative.draft_search import Candidates, LoopOutput, search, top_k

GraphOutput = LoopOutput | tuple[torch.Tensor, torch.Tensor]  # a loop's, or extend's
LoopKey = tuple[int, int]  # (bucket, key width)
LoopViews = dict[str, torch.Tensor]  # the staged buffers, by ``LOOP_FIELDS`` name


def eagle_loop(draft: EagleHead, pool: KVCache, table: torch.Tensor, topk: int,
               steps: int, max_kv: int, topk_p: torch.Tensor, topk_index: torch.Tensor,
               hidden: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor,
               scratch: torch.Tensor) -> LoopOutput:
    b, k = rows.shape[0], topk
    kv = InPlaceKV(pool.k, pool.v)

    def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        block = (torch.ones((b, 1, i), dtype=torch.bool, device=rows.device)
                 if node_mask is None else node_mask[:, :, :i * k])
        attention = AttentionMetadata.over_blocks(table, rows, roots, max_kv, block)
        positions = (roots + (i - 1))[:, None].expand(b, k).reshape(-1)
        return draft.compute(tokens, features, positions, attention,
                             scratch[:, (i - 1) * k:i * k].reshape(-1), kv)

    return search(topk_p, topk_index, hidden, steps, forward)


def eagle_extend(draft: EagleHead, pool: KVCache, table: torch.Tensor, topk: int,
                 steps: int, max_kv: int, ids: torch.Tensor, hidden: torch.Tensor,
                 rows: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's draft-extend (``EagleDrafter.extend``) on ``N`` rows per request: its
    accepted tokens right-aligned, ending before ``ends`` (the root), after front padding
    (token 0, zero features, the dummy slot). Every row writes the head's KV; only each
    request's last row, its newest accepted token, goes on through attention, MLP, norm and
    LM head, as the eager forward's ``keep`` does. -> (logits, predicted features), a row per
    request."""
    b, n = ids.shape
    columns = torch.arange(n, device=ids.device)
    positions = (ends[:, None] - n + columns).clamp(min=0).reshape(-1)
    last = torch.arange(b, device=ids.device) * n + (n - 1)
    attention = AttentionMetadata.over_blocks(table, rows, ends - 1, max_kv)  # the last rows
    return draft.compute(ids.reshape(-1), hidden.reshape(b * n, -1), positions, attention,
                         slots.reshape(-1), InPlaceKV(pool.k, pool.v), keep=last)


def mtp_loop(draft: FrozenKVMTPDraftModel, pool: KVCache, table: torch.Tensor, topk: int,
             steps: int, max_kv: int, bonus_tokens: torch.Tensor, hidden: torch.Tensor,
             rows: torch.Tensor, seq_lens: torch.Tensor) -> LoopOutput:
    """The seed (iteration 0) over one row per request, then ``steps - 1`` iterations over
    ``topk`` rows per request; every query sits at ``seq_len - 1`` and sees ``[0, seq_len)``,
    so one metadata serves them all."""
    k = topk
    expanded = AttentionMetadata.over_blocks(table, rows.repeat_interleave(k),
                                             (seq_lens - 1).repeat_interleave(k), max_kv)
    positions = (seq_lens - 1).clamp(min=0).repeat_interleave(k)
    seed = AttentionMetadata(expanded.kv_slots[::k], expanded.mask[::k])
    logits, seed_hidden = draft.compute(bonus_tokens, hidden, positions[::k], seed, pool)
    topk_p, topk_index = top_k(logits, k)

    def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return draft.compute(tokens, features, positions, expanded, pool)

    return search(topk_p, topk_index, seed_hidden, steps, forward)


LOOPS: dict[str, Callable[..., GraphOutput]] = {
    "draft:eagle": eagle_loop, "draft:mtp": mtp_loop, "extend:eagle": eagle_extend}


def flatten(out: GraphOutput) -> tuple[torch.Tensor, ...]:
    if isinstance(out, Candidates):
        return (out.scores, out.tokens, out.parents)
    return out if isinstance(out, tuple) else (out,)


def unflatten(tensors: Sequence[torch.Tensor]) -> GraphOutput:
    """``flatten``'s inverse: a chain's tokens (one tensor), extend's pair, a beam's three."""
    if len(tensors) == 1:
        return tensors[0]
    if len(tensors) == 2:
        return (tensors[0], tensors[1])
    return Candidates(*tensors)


class LoopProgram:
    """One loop kind over a draft model, its KV pool (EAGLE's draft pool, or the target's pool
    that Frozen-KV MTP reads) and the row table, for staged buffers in ``fields`` order.
    ``rows_per_request``: what one forward of the step multiplies per request (a draft step's
    top-k beams, or the extend's ``N`` rows)."""

    def __init__(self, kind: str, draft: EagleHead | FrozenKVMTPDraftModel,
                 pool: KVCache, table: torch.Tensor, topk: int, steps: int,
                 fields: Sequence[str], rows_per_request: int) -> None:
        self.kind, self.loop = kind, LOOPS[kind]
        self.draft, self.pool, self.table = draft, pool, table
        self.topk, self.steps = topk, steps
        self.fields, self.rows_per_request = list(fields), rows_per_request

    def run(self, key: LoopKey, views: LoopViews) -> GraphOutput:
        return self.loop(self.draft, self.pool, self.table, self.topk, self.steps, key[1],
                         **views)

    def module(self, key: LoopKey) -> torch.nn.Module:
        return LoopForward(self, key[1])

    def weights(self) -> torch.nn.Module:
        return LoopForward(self, 0)

    def inputs(self, views: LoopViews) -> list[torch.Tensor]:
        return [self.pool.k, self.pool.v, self.table, *(views[f] for f in self.fields)]

    def outputs(self, tensors: Sequence[torch.Tensor]) -> GraphOutput:
        return unflatten(tensors)

    def package(self, key: LoopKey, views: LoopViews) -> PackageSpec:
        """``draft-eagle-k4-s3-b8-kv256``, ``extend-eagle-k1-s3-n4-b8-kv256``: the loop's
        top-k, steps and (extend) rows per request are baked into its code."""
        extend = f"-n{self.rows_per_request}" if self.kind == "extend:eagle" else ""
        pool, table = open_limits()
        return PackageSpec(f"{self.kind.replace(':', '-')}-k{self.topk}-s{self.steps}{extend}"
                           f"-b{key[0]}-kv{key[1]}", key[0] * self.rows_per_request,
                           [pool, pool, table])


class LoopForward(torch.nn.Module):
    """A loop at one key width as a module to compile or export: the draft's weights (and the
    target's embedding, LM head and rotary tables it borrows, registered here so a package's
    weights digest covers them) are its own; the pool, the row table and the staged buffers
    (in ``fields`` order) are its inputs; its outputs are flat tensors."""

    def __init__(self, program: LoopProgram, max_kv: int) -> None:
        super().__init__()
        draft = program.draft
        self.draft = draft
        for name in ("target_embed", "target_lm_head"):
            if hasattr(draft, name):
                self.add_module(f"borrowed_{name}", getattr(draft, name))
        register_tables(self, draft.rotary)
        self.loop, self.fields = program.loop, program.fields
        self.topk, self.steps, self.max_kv = program.topk, program.steps, max_kv

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``inputs``: the pool's K and V, the row table, the staged buffers."""
        k_pool, v_pool, table, *views = inputs
        return flatten(self.loop(self.draft, InPlaceKV(k_pool, v_pool), table, self.topk,
                                 self.steps, self.max_kv,
                                 **dict(zip(self.fields, views, strict=True))))
