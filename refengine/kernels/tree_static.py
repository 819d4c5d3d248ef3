"""The greedy tree walk in fixed-shape tensor ops: what a verify graph captures.

The same rule as ``tree_reference.greedy_walk`` (its oracle, checked against it in
``tests/test_tree_static.py``): from the root, at each node take the first child in sibling
order whose token equals the target's argmax after the node, at most ``max_depth`` times; the
bonus is the argmax after the last accepted node. Here the tree comes as the verify forward
already holds it (node tokens and the ``[N, N]`` ancestor mask, no linked lists) and every
step is a whole-batch op with no host read and no data-dependent shape, so a CUDA graph, a
compiled key or an AOT package runs the walk inside the verify forward, and the step reads its
result back in the one transfer it makes anyway.

Siblings are chained in ascending node order (``tree_reference``), so the first matching
child in sibling order is the matching child with the lowest node index.
"""

from __future__ import annotations

import torch


def greedy_walk_static(tokens: torch.Tensor, tree_mask: torch.Tensor, predict: torch.Tensor,
                       max_depth: int) -> torch.Tensor:
    """``tokens [b, N]`` (node 0 the root), ``tree_mask [b, N, N]`` (node i sees j iff j is
    i or an ancestor of i), ``predict [b, N]`` (the target's argmax after each node) ->
    ``[b, max_depth + 3]`` int64: the accepted node indices (root first, -1 padded), the
    accepted draft count, the bonus token (``GreedyVerifyResult``'s fields, side by side)."""
    b, n = tokens.shape
    nodes = torch.arange(n, device=tokens.device)
    depth = tree_mask.sum(-1) - 1                                    # ancestors, self excluded
    # A node's parent is its ancestor one level up (the root has none: parent 0, never a
    # candidate, since only nodes at depth d + 1 are tried at step d).
    is_parent = tree_mask & (depth[:, None, :] == depth[:, :, None] - 1)
    parent = torch.where(is_parent, nodes, 0).amax(-1)                # [b, N]
    matches = tokens == predict.gather(1, parent)                     # child token == argmax
    current = torch.zeros(b, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(b, dtype=torch.bool, device=tokens.device)
    accepted = [current]
    for step in range(max_depth):
        candidate = matches & (parent == current[:, None]) & (depth == step + 1)
        first = torch.where(candidate, nodes, n).amin(-1)            # lowest index: first sibling
        alive = alive & (first < n)
        current = torch.where(alive, first, current)
        accepted.append(torch.where(alive, first, -1))
    accept_index = torch.stack(accepted, dim=1)                      # [b, max_depth + 1]
    accept_len = (accept_index[:, 1:] >= 0).sum(-1)
    bonus = predict.gather(1, current[:, None])[:, 0]
    return torch.cat([accept_index, accept_len[:, None], bonus[:, None]], dim=1)
