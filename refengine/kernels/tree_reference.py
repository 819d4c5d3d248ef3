"""Torch references for the tree kernels: build the verify tree, greedy tree verify.

These are the engine's CPU path and the oracle the Triton kernels (``tree_triton.py``) are
checked against. Layout conventions (sglang's, so readers of either can read the other):

* Draft candidates per request are flat: step 1's ``k`` children of the root, then for each
  later step ``k * k`` children (beam node major, rank minor). ``cand_parents[c]`` is the flat
  index of c's parent candidate, or -1 for children of the root.
* The tree has ``N`` nodes: node 0 is the root (the last verified token); nodes 1..N-1 are the
  selected candidates in ascending flat order, so every parent precedes its children.
* ``next_token[i]`` is i's first child, ``next_sibling[i]`` its next sibling (-1: none);
  siblings are chained in ascending node order, i.e. descending draft score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.device import from_host


@dataclass
class Tree:
    tokens: torch.Tensor        # [b, N] node tokens, node 0 = root
    parents: torch.Tensor       # [b, N] parent node, -1 for the root
    depth: torch.Tensor         # [b, N] 0 for the root
    mask: torch.Tensor          # [b, N, N] node i sees j iff j is i or an ancestor of i
    next_token: torch.Tensor    # [b, N]
    next_sibling: torch.Tensor  # [b, N]


def select_candidates(scores: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Flat indices [b, N-1] of the best candidates by path score, ascending.

    Ties go to the lower flat index (a stable sort), so a parent — whose score is never lower
    than its child's and whose index is always lower — is chosen before its child: the set is a
    rooted subtree even when a child's probability rounds to 1.
    """
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, : num_nodes - 1]
    return torch.sort(order, dim=-1).values


def build_tree_reference(root: torch.Tensor, cand_tokens: torch.Tensor,
                         cand_parents: torch.Tensor, selected: torch.Tensor) -> Tree:
    """root [b]; cand_tokens / cand_parents [b, C]; selected [b, N-1] ascending flat indices."""
    b, n, device = root.shape[0], selected.shape[1] + 1, root.device
    tokens = torch.cat([root[:, None], torch.gather(cand_tokens, 1, selected)], dim=1)
    # both index lists in one transfer
    chosen_rows, flat_parents = torch.stack(
        [selected.long(), torch.gather(cand_parents, 1, selected).long()]).tolist()
    parents = [[-1] * n for _ in range(b)]
    depth = [[0] * n for _ in range(b)]
    next_token = [[-1] * n for _ in range(b)]
    next_sibling = [[-1] * n for _ in range(b)]
    mask = [[[False] * n for _ in range(n)] for _ in range(b)]
    for r, chosen in enumerate(chosen_rows):
        node_of = {c: i + 1 for i, c in enumerate(chosen)}
        ancestors: list[list[int]] = [[0]]
        for i in range(1, n):
            flat_parent = flat_parents[r][i - 1]
            p = 0 if flat_parent < 0 else node_of.get(flat_parent)
            if p is None:
                raise ValueError(f"request row {r}: node {i} selected without its parent")
            parents[r][i] = p
            depth[r][i] = depth[r][p] + 1
            ancestors.append([*ancestors[p], i])
        for i in range(n - 1, 0, -1):  # push at the head: siblings end up in ascending order
            p = parents[r][i]
            next_sibling[r][i] = next_token[r][p]
            next_token[r][p] = i
        for i, seen in enumerate(ancestors):
            for j in seen:
                mask[r][i][j] = True

    def as_tensor(rows: list[list[int]]) -> torch.Tensor:  # [b, n] even when b == 0
        return from_host(rows, device).reshape(b, n)

    return Tree(tokens, as_tensor(parents), as_tensor(depth),
                from_host(mask, device, torch.bool).reshape(b, n, n),
                as_tensor(next_token), as_tensor(next_sibling))


@dataclass
class GreedyVerifyResult:
    accept_index: torch.Tensor  # [b, S+1] accepted node indices, root first, -1 padded
    accept_len: torch.Tensor    # [b] accepted draft nodes (bonus excluded)
    bonus: torch.Tensor         # [b] the target's token after the last accepted node


def greedy_walk(tokens: list[list[int]], next_token: list[list[int]],
                next_sibling: list[list[int]], target_predict: list[list[int]],
                max_depth: int) -> tuple[list[list[int]], list[int], list[int]]:
    """The greedy tree walk on Python lists (the engine's path: its caller already holds the
    tree as lists, and small tensors cost an op each way). Returns ``(accept_index,
    accept_len, bonus)`` as ``GreedyVerifyResult`` describes them."""
    b = len(tokens)
    accept_index = [[-1] * (max_depth + 1) for _ in range(b)]
    accept_len = [0] * b
    bonus = [0] * b
    for r in range(b):
        tok, first, sibling, want = tokens[r], next_token[r], next_sibling[r], target_predict[r]
        last, n = 0, 0
        accept_index[r][0] = 0
        for _ in range(max_depth):
            child = first[last]
            while child != -1 and tok[child] != want[last]:
                child = sibling[child]
            if child == -1:
                break
            n += 1
            accept_index[r][n] = child
            last = child
        accept_len[r] = n
        bonus[r] = want[last]
    return accept_index, accept_len, bonus


def verify_tree_greedy_reference(tokens: torch.Tensor, next_token: torch.Tensor,
                                 next_sibling: torch.Tensor, target_predict: torch.Tensor,
                                 max_depth: int) -> GreedyVerifyResult:
    """Walk from the root: at each node take the first child (in sibling order) whose token
    equals the target's argmax after the node; stop when none does or at ``max_depth``.

    ``target_predict[r, i]`` is the target's argmax token after node i.
    """
    b, device = tokens.shape[0], tokens.device
    accept_index, accept_len, bonus = greedy_walk(
        *(t.tolist() for t in (tokens, next_token, next_sibling, target_predict)), max_depth)
    return GreedyVerifyResult(
        from_host(accept_index, device).reshape(b, max_depth + 1),
        from_host(accept_len, device), from_host(bonus, device))
