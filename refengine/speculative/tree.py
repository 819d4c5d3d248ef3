"""The verify tree of a decode step, from what the draft found.

A chain (``topk == 1``: the root, then its draft tokens) is its own tree, with causal
attention; of a beam's candidates the best ``N - 1`` by path score form the tree
(``kernels.tree_reference``; on a GPU the Triton kernel, ``kernels.dispatch``). The root
token always comes from the step's draft state, never from a graph's output.
"""

from __future__ import annotations

import torch

from refengine.device import from_host
from refengine.kernels.dispatch import build_tree
from refengine.kernels.tree_reference import select_candidates
from refengine.speculative.draft_search import Candidates, LoopOutput
from refengine.speculative.inputs import VerifyInput


class ChainTree:
    """The verify tree of a chain of ``n`` nodes: node i sits at depth i, sees nodes 0..i
    (causal), has parent i - 1 and first child i + 1. It never changes, so its tensors are
    built once per device and batch size and handed out as views (consumers read a
    VerifyInput, they never write it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._depth: dict[torch.device, torch.Tensor] = {}
        self._by_batch: dict[tuple[torch.device, int], dict[str, torch.Tensor]] = {}

    def depth(self, device: torch.device) -> torch.Tensor:
        """``[n]``: each node's depth (its index), on ``device``."""
        if device not in self._depth:
            self._depth[device] = torch.arange(self.n, device=device)
        return self._depth[device]

    def _structure(self, device: torch.device, b: int) -> dict[str, torch.Tensor]:
        """The VerifyInput fields that depend only on the device and the batch size."""
        if (device, b) not in self._by_batch:
            n, node = self.n, self.depth(device)
            self._by_batch[device, b] = {
                "tree_mask": (node[None, :] <= node[:, None]).expand(b, n, n),
                "parents": (node - 1).expand(b, n),
                "retrieve_index": torch.arange(b * n, device=device).view(b, n),
                "retrieve_next_token": torch.where(node < n - 1, node + 1, -1).expand(b, n),
                "retrieve_next_sibling": torch.full((b, n), -1, device=device)}
        return self._by_batch[device, b]

    def verify_input(self, tokens: torch.Tensor, roots: list[int]) -> VerifyInput:
        """``tokens [b, n]`` (root first); ``roots``: each root's position."""
        device = tokens.device
        return VerifyInput(draft_tokens=tokens,
                           positions=from_host(roots, device)[:, None] + self.depth(device),
                           **self._structure(device, tokens.shape[0]), roots=roots)


def tree_verify_input(root_tokens: torch.Tensor, found: Candidates, roots: list[int],
                      num_draft_tokens: int) -> VerifyInput:
    """The verify tree of ``num_draft_tokens`` nodes from a beam's candidates (``roots``:
    each root's position)."""
    n, b, device = num_draft_tokens, root_tokens.shape[0], root_tokens.device
    tree = build_tree(root_tokens, found.tokens, found.parents,
                      select_candidates(found.scores, n))
    flat = torch.arange(b * n, device=device).view(b, n)
    return VerifyInput(tree.tokens, tree.mask, from_host(roots, device)[:, None] + tree.depth,
                       tree.parents, flat, tree.next_token, tree.next_sibling, roots=roots)


def verify_input(chain: ChainTree, root_tokens: torch.Tensor, found: LoopOutput,
                 roots: list[int], num_draft_tokens: int) -> VerifyInput:
    """A chain's tree (``found``: its draft tokens) or a beam's (``found``: candidates)."""
    if isinstance(found, Candidates):
        return tree_verify_input(root_tokens, found, roots, num_draft_tokens)
    return chain.verify_input(torch.cat([root_tokens[:, None], found], dim=1), roots)
