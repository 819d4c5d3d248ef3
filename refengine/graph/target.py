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

from refengine.graph.compile import InPlaceKV
from refengine.graph.export import open_limits, register_tables
from refengine.graph.program import PackageSpec
from refengine.graph.staging import StagedViews, static_attention
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
from refengine.runner import ModelRunner


class GraphKey(NamedTuple):
    kind: str     # "decode" or "verify"
    bucket: int   # padded batch size (requests)
    max_kv: int   # key columns every request's attention spans


# Tensors (and modules) only as arguments, no StagedViews: Dynamo would specialise on its ints
# (the raw size).
def whole_forward(model: LlamaForCausalLM, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                  rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                  table: torch.Tensor, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward over a staged bucket, every write through ``refengine::write_kv``."""
    attention = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    normed, drafted = model.features(input_ids, positions, attention, out_slots,
                                     InPlaceKV(k_pool, v_pool))
    return model.logits(normed), drafted


class KeyForward(torch.nn.Module):
    """The whole forward at one key width, as a module (its weights are the model's, and its
    feature tap's, registered here so a package's weights digest covers them; the pools,
    staged views and row table are its inputs)."""

    def __init__(self, model: LlamaForCausalLM, max_kv: int) -> None:
        super().__init__()
        self.model, self.max_kv = model, max_kv
        if isinstance(model.feature_tap, torch.nn.Module):
            self.add_module("feature_tap", model.feature_tap)
        register_tables(self, model.rotary)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs``: the pools, the staged views and the row table, in ``whole_forward``'s
        order."""
        return whole_forward(self.model, *inputs, self.max_kv)


class TargetForward:
    """The target's decode and verify keys over ``runner``'s model, KV pool and row table."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model, self.kv, self.table = runner.target, runner.kv.target_pool, runner.kv.rows.table

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        """The model's own forward over the padded static views (what a graph captures)."""
        attention = static_attention(views.rows, views.seq_lens, views.tree_mask, self.table,
                                     key.max_kv)
        return self.runner.forward(ForwardBatch(views.input_ids, views.positions,
                                                views.out_slots, attention))

    def module(self, key: GraphKey) -> torch.nn.Module:
        return KeyForward(self.model, key.max_kv)

    def weights(self) -> torch.nn.Module:
        return KeyForward(self.model, 0)

    def inputs(self, views: StagedViews) -> list[torch.Tensor]:
        return [self.kv.k, self.kv.v, views.input_ids, views.positions, views.out_slots,
                views.rows, views.seq_lens, views.tree_mask, self.table]

    def outputs(self, tensors: Sequence[torch.Tensor]) -> ForwardOutput:
        logits, features = tensors
        return ForwardOutput(logits, features)

    def package(self, key: GraphKey, views: StagedViews) -> PackageSpec:
        """``decode-b8-kv256``, ``verify-n4-b8-kv256``: a verify key names its tokens per
        request; its forwards multiply bucket times that many rows."""
        pool, table = open_limits()
        tokens = f"-n{views.q}" if views.q > 1 else ""
        return PackageSpec(f"{key.kind}{tokens}-b{key.bucket}-kv{key.max_kv}",
                           key.bucket * views.q, [pool, pool, *[None] * 6, table])
