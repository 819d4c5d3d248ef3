"""The target's static forward (a ``Program``): a decode or verify key's forward over the
staged views, as the executors run it.

Eagerly (``run``) it is the wrapped runner's own forward over a batch built on the padded
views, its attention derived from them (``static_attention``); as a key module
(``KeyForward``) it composes the model's own pieces (``LlamaForCausalLM.features``/``logits``)
with every KV write through ``refengine::write_kv`` (``InPlaceKV``), so the compiled and
exported forwards leave the pool's updates untraced; the replay-vs-compiled tests with the
"eager" backend check both give the model's bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from refengine.graph.export import open_limits, register_tables
from refengine.graph.forward import verify_walk, whole_forward
from refengine.graph.program import PackageSpec
from refengine.graph.staging import StagedViews, static_attention
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
from refengine.runner import ModelRunner


class GraphKey(NamedTuple):
    kind: str     # "decode" or "verify"
    bucket: int   # padded batch size (requests)
    max_kv: int   # key columns every request's attention spans


class KeyForward(torch.nn.Module):
    """The whole forward at one key width, as a module (its weights are the model's, and its
    feature tap's, registered here so a package's weights digest covers them; the pools,
    staged views and row table are its inputs)."""

    def __init__(self, model: LlamaForCausalLM, max_kv: int, walk_depth: int | None) -> None:
        super().__init__()
        self.model, self.max_kv, self.walk_depth = model, max_kv, walk_depth
        if isinstance(model.feature_tap, torch.nn.Module):
            self.add_module("feature_tap", model.feature_tap)
        register_tables(self, model.rotary)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``inputs``: the pools, the staged views and the row table, in ``whole_forward``'s
        order."""
        return whole_forward(self.model, *inputs, self.max_kv, self.walk_depth)


class TargetForward:
    """The target's decode and verify keys over ``runner``'s model, KV pool and row table.
    With ``walk_depth`` (the speculative steps S), a verify key also walks its trees on the
    device (``verify_walk``): the step then reads the accepted path with the rest of its
    results, and no kernel runs for it outside the graph."""

    def __init__(self, runner: ModelRunner, walk_depth: int | None = None) -> None:
        self.runner, self.walk_depth = runner, walk_depth
        self.model, self.kv, self.table = runner.target, runner.kv.target_pool, runner.kv.rows.table

    def depth(self, key: GraphKey) -> int | None:
        """The walk depth of ``key``'s forward: None for decode (nothing to walk)."""
        return self.walk_depth if key.kind == "verify" else None

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        """The model's own forward over the padded static views (what a graph captures)."""
        attention = static_attention(views.rows, views.seq_lens, views.tree_mask, self.table,
                                     key.max_kv)
        out = self.runner.forward(ForwardBatch(views.input_ids, views.positions,
                                               views.out_slots, attention))
        depth = self.depth(key)
        if depth is not None:
            out.walk = verify_walk(out.logits, views.input_ids, views.tree_mask, depth)
        return out

    def module(self, key: GraphKey) -> torch.nn.Module:
        return KeyForward(self.model, key.max_kv, self.depth(key))

    def weights(self) -> torch.nn.Module:
        return KeyForward(self.model, 0, None)

    def inputs(self, views: StagedViews) -> list[torch.Tensor]:
        return [self.kv.k, self.kv.v, views.input_ids, views.positions, views.out_slots,
                views.rows, views.seq_lens, views.tree_mask, self.table]

    def outputs(self, tensors: Sequence[torch.Tensor]) -> ForwardOutput:
        return ForwardOutput(*tensors)

    def package(self, key: GraphKey, views: StagedViews) -> PackageSpec:
        """``decode-b8-kv256``, ``verify-n4-b8-kv256``, ``verify-n4-s3-b8-kv256``: a verify
        key names its tokens per request and the depth of the walk baked into it; its
        forwards multiply bucket times that many rows."""
        pool, table = open_limits()
        tokens = f"-n{views.q}" if views.q > 1 else ""
        depth = self.depth(key)
        walk = "" if depth is None else f"-s{depth}"
        return PackageSpec(f"{key.kind}{tokens}{walk}-b{key.bucket}-kv{key.max_kv}",
                           key.bucket * views.q, [pool, pool, *[None] * 6, table])
