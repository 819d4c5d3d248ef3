"""Which tree kernels the engine runs: the compiled Triton kernels on a CUDA device, the torch
references everywhere else (``tree_kernels`` decides), behind the references' contracts.

The greedy verify ends on the host either way (resolve appends Python ints), so it is shaped
around that: on a GPU the walk runs on the device and its results come back together with the
tree's tokens in one transfer; on a CPU the walk's inputs come over in one transfer and the
reference walk runs on the lists.
"""

from __future__ import annotations

from typing import Literal

import torch

from refengine.kernels.tree_reference import Tree, build_tree_reference, greedy_walk
from refengine.kernels.tree_triton import (
    build_tree_triton,
    interpreter_enabled,
    triton_runnable,
    verify_tree_greedy_triton,
)

TreeKernels = Literal["triton", "reference"]


def tree_kernels(tensor: torch.Tensor) -> TreeKernels:
    """``"triton"`` for tensors on a CUDA device where Triton is installed (and not switched to
    its interpreter), else ``"reference"``. On a CPU Triton only runs under its interpreter,
    orders of magnitude slower than the torch references and a test instrument, never the
    engine's path; on a GPU the compiled kernels replace a host round-trip per tree with device
    work."""
    if tensor.is_cuda and not interpreter_enabled() and triton_runnable():
        return "triton"
    return "reference"


def build_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
               selected: torch.Tensor) -> Tree:
    """``build_tree_reference``'s contract, on the kernels ``tree_kernels`` picks."""
    kernel = build_tree_triton if tree_kernels(root) == "triton" else build_tree_reference
    return kernel(root, cand_tokens, cand_parents, selected)


GreedyLists = tuple[list[list[int]], list[list[int]], list[int], list[int]]


def greedy_verify_lists(tokens: torch.Tensor, next_token: torch.Tensor,
                        next_sibling: torch.Tensor, target_predict: torch.Tensor,
                        max_depth: int) -> GreedyLists:
    """The greedy tree walk (``verify_tree_greedy_reference``'s contract) with its results on
    the host: ``(tokens, accept_index, accept_len, bonus)`` as Python lists, the tree's tokens
    included (resolve emits them). One device-to-host transfer on either path."""
    if tree_kernels(tokens) == "triton":
        result = verify_tree_greedy_triton(tokens, next_token, next_sibling, target_predict,
                                           max_depth)
        return walk_lists(tokens, torch.cat([result.accept_index, result.accept_len[:, None],
                                             result.bonus[:, None]], dim=1))
    lists = torch.stack([tokens, next_token, next_sibling, target_predict]).tolist()
    return (lists[0], *greedy_walk(*lists, max_depth))


def walk_lists(tokens: torch.Tensor, walk: torch.Tensor) -> GreedyLists:
    """A walk already made on the device (``walk [b, S + 3]``: accepted nodes, their count,
    the bonus, as ``tree_static.greedy_walk_static`` packs them) with the tree's tokens
    ``[b, N]``, as ``greedy_verify_lists`` returns them: one device-to-host transfer."""
    n = tokens.shape[1]
    host = torch.cat([tokens, walk], dim=1).tolist()
    return ([row[:n] for row in host], [row[n:-2] for row in host],
            [row[-2] for row in host], [row[-1] for row in host])
