"""The greedy walk in fixed-shape tensor ops (``kernels.tree_static``) against the host walk
it restates (``tree_reference``), on the trees the engine's builder lays out and on chains."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.tree_cases import TreeCase, tree_cases
from refengine.kernels.tree_reference import build_tree_reference, verify_tree_greedy_reference
from refengine.kernels.tree_static import greedy_walk_static
from refengine.speculative.tree import ChainTree

CASES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def _host_walk(tokens: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
               predict: torch.Tensor, max_depth: int) -> torch.Tensor:
    want = verify_tree_greedy_reference(tokens, next_token, next_sibling, predict, max_depth)
    return torch.cat([want.accept_index, want.accept_len[:, None], want.bonus[:, None]], dim=1)


@CASES
@given(tree_cases())
def test_static_walk_is_the_host_walk_on_built_trees(case: TreeCase) -> None:
    tree = build_tree_reference(case.root, case.cand_tokens, case.cand_parents, case.selected)
    got = greedy_walk_static(tree.tokens, tree.mask, case.target_predict, case.max_depth)
    want = _host_walk(tree.tokens, tree.next_token, tree.next_sibling, case.target_predict,
                      case.max_depth)
    assert torch.equal(got, want), case.describe()


@CASES
@given(st.integers(1, 6), st.integers(2, 8), st.integers(2, 6), st.floats(0.0, 1.0),
       st.integers(0, 2**32 - 1))
def test_static_walk_is_the_host_walk_on_chains(b: int, n: int, vocab: int, agree: float,
                                                seed: int) -> None:
    """A chain's walk stops at the first draft the target disagrees with; ``agree``: how often
    the target's argmax is the next draft token (long accepted runs as well as none)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (b, n), generator=gen)
    predict = torch.randint(vocab, (b, n), generator=gen)
    keep = torch.rand((b, n - 1), generator=gen) < agree
    predict[:, :-1] = torch.where(keep, tokens[:, 1:], predict[:, :-1])
    chain = ChainTree(n).verify_input(tokens, [0] * b)
    got = greedy_walk_static(tokens, chain.tree_mask, predict, n - 1)
    want = _host_walk(tokens, chain.retrieve_next_token, chain.retrieve_next_sibling, predict,
                      n - 1)
    assert torch.equal(got, want)


def test_static_walk_takes_the_first_matching_sibling() -> None:
    """Two children of the root carry the target's token: the lower node (the first sibling)
    is taken, and the walk goes on below it, not below the other."""
    parents = [-1, 0, 0, 1, 2]
    n = len(parents)
    mask = torch.zeros((1, n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[0, i, j] = True
            j = parents[j]
    tokens = torch.tensor([[9, 5, 5, 7, 8]])
    predict = torch.tensor([[5, 7, 8, 3, 4]])  # after node 1: 7 (its child 3); after 2: 8
    got = greedy_walk_static(tokens, mask, predict, 2)
    assert got.tolist() == [[0, 1, 3, 2, 3]]  # nodes 0, 1, 3; two accepted; bonus 3
