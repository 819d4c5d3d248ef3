"""The target's forward over staged tensors, as every compiled graph runs it: the decode and
verify keys (``target.py``) and the one-graph steps (``step_graph.py``), with the greedy walk
of a verify's trees."""

from __future__ import annotations

import torch

from refengine.graph.compile import InPlaceKV
from refengine.graph.staging import static_attention
from refengine.kernels.tree_static import greedy_walk_static
from refengine.model.llama import LlamaForCausalLM


def verify_walk(logits: torch.Tensor, input_ids: torch.Tensor, tree_mask: torch.Tensor,
                depth: int) -> torch.Tensor:
    """The greedy walk of a staged verify bucket's trees (``greedy_walk_static``) over its
    logits: ``[bucket, depth + 3]``."""
    b, q = tree_mask.shape[:2]
    return greedy_walk_static(input_ids.view(b, q), tree_mask, logits.argmax(-1).view(b, q),
                              depth)


# Tensors (and modules) only as arguments, no StagedViews: Dynamo would specialise on its ints
# (the raw size).
def whole_forward(model: LlamaForCausalLM, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                  rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                  table: torch.Tensor, max_kv: int, walk_depth: int | None
                  ) -> tuple[torch.Tensor, ...]:
    """The model's forward over a staged bucket, every write through ``refengine::write_kv``;
    with ``walk_depth`` (a verify key) the greedy walk too."""
    attention = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    normed, drafted = model.features(input_ids, positions, attention, out_slots,
                                     InPlaceKV(k_pool, v_pool))
    logits = model.logits(normed)
    if walk_depth is None:
        return logits, drafted
    return logits, drafted, verify_walk(logits, input_ids, tree_mask, walk_depth)
