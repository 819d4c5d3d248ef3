"""The torch tree references: candidate selection, tree build, greedy verify, and tree
speculative sampling (``refengine.speculative.verify``).

These references are both the engine's CPU path and the oracle of the ``kernel`` tier, so they
are checked here against properties stated independently of their code (and the published
sgl-kernel vector), not against themselves.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings

from conformance.checks.tree_cases import (
    ORPHAN_ERROR,
    TreeCase,
    orphan_tree_args,
    published_greedy_vector,
    tree_cases,
)
from refengine.kernels.tree_reference import (
    Tree,
    build_tree_reference,
    select_candidates,
    verify_tree_greedy_reference,
)
from refengine.speculative.verify import verify_tree_sampling

CASES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def _tree(case: TreeCase) -> Tree:
    return build_tree_reference(case.root, case.cand_tokens, case.cand_parents, case.selected)


def _children(tree: Tree, r: int, p: int) -> list[int]:
    """p's children by walking its sibling chain."""
    out, c = [], int(tree.next_token[r, p])
    while c != -1:
        out.append(c)
        c = int(tree.next_sibling[r, c])
    return out


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = set()
    while parents[i] != -1:
        i = parents[i]
        out.add(i)
    return out


# --- the published vector ---------------------------------------------------------------------


def test_published_vector() -> None:
    v = published_greedy_vector()
    got = verify_tree_greedy_reference(v.tokens, v.next_token, v.next_sibling,
                                       v.target_predict, v.max_depth)
    assert got.accept_index.tolist() == [[0, 3, 4, 5], [0, 4, 5, -1]]
    assert got.accept_len.tolist() == [3, 2]
    assert got.bonus.tolist() == [18, 18]


# --- selection ----------------------------------------------------------------------------------


@CASES
@given(case=tree_cases())
def test_selection_is_the_best_rooted_subtree(case: TreeCase) -> None:
    sel = case.selected
    assert sel.shape == (case.root.shape[0], case.num_nodes - 1)
    for r in range(sel.shape[0]):
        chosen = sel[r].tolist()
        assert chosen == sorted(set(chosen)), "ascending, no repeats"
        for c in chosen:  # closed under "parent of"
            p = int(case.cand_parents[r, c])
            assert p == -1 or p in chosen, f"row {r}: {c} chosen without its parent {p}"
        rest = torch.ones(case.scores.shape[1], dtype=torch.bool)
        rest[chosen] = False
        if rest.any():  # the best N-1 by score (ties at the cut may go either way)
            assert case.scores[r, chosen].min() >= case.scores[r, rest].max()


def test_selection_ties_child_probability_one() -> None:
    """A chain whose every later step has probability exactly 1.0: all path scores tie, and
    the stable sort must still choose parents before children (a plain descending sort is free
    to pick the deepest nodes)."""
    scores = torch.tensor([[0.7, 0.7, 0.7, 0.7]])           # k = 1, steps = 4
    assert select_candidates(scores, 3).tolist() == [[0, 1]]
    assert select_candidates(scores, 5).tolist() == [[0, 1, 2, 3]]


def test_selection_ties_at_the_cut_across_parents() -> None:
    """k = 2: the root's children tie at 0.5; node 0's best child has probability 1.0 (score
    0.5, a three-way tie). Cutting inside the tie keeps the lowest flat indices, which are the
    parents: {0, 1}, then {0, 1, 2} (2 is 0's child)."""
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.25, 0.25]])
    parents = [-1, -1, 0, 0, 1, 1]
    for n, want in ((3, [0, 1]), (4, [0, 1, 2]), (6, [0, 1, 2, 4, 5])):
        got = select_candidates(scores, n)[0].tolist()
        assert got == want
        assert all(parents[c] == -1 or parents[c] in got for c in got)


# --- tree build ---------------------------------------------------------------------------------


@CASES
@given(case=tree_cases())
def test_tree_is_well_formed(case: TreeCase) -> None:
    tree = _tree(case)
    b, n = case.root.shape[0], case.num_nodes
    for field in (tree.tokens, tree.parents, tree.depth, tree.next_token, tree.next_sibling):
        assert field.shape == (b, n)
    assert tree.mask.shape == (b, n, n) and tree.mask.dtype == torch.bool
    for r in range(b):
        parents = tree.parents[r].tolist()
        assert parents[0] == -1 and int(tree.depth[r, 0]) == 0
        assert int(tree.tokens[r, 0]) == int(case.root[r])
        seen_as_child = []
        for i in range(1, n):
            flat, p = int(case.selected[r, i - 1]), parents[i]
            assert 0 <= p < i, "a parent precedes its child"
            assert int(tree.tokens[r, i]) == int(case.cand_tokens[r, flat])
            # the node parent is the node holding the candidate's flat parent
            flat_parent = int(case.cand_parents[r, flat])
            assert flat_parent == (-1 if p == 0 else int(case.selected[r, p - 1]))
            assert int(tree.depth[r, i]) == int(tree.depth[r, p]) + 1 <= case.steps
            row = set(tree.mask[r, i].nonzero().flatten().tolist())
            assert row == _ancestors(parents, i) | {i}, f"mask row {i}"
        assert tree.mask[r, 0].nonzero().flatten().tolist() == [0]
        for p in range(n):
            kids = _children(tree, r, p)
            assert kids == sorted(i for i in range(1, n) if parents[i] == p), \
                f"row {r}: node {p}'s sibling chain"
            flats = [int(case.selected[r, c - 1]) for c in kids]
            assert case.scores[r, flats].tolist() == sorted(case.scores[r, flats].tolist(),
                                                            reverse=True)
            seen_as_child += kids
        assert sorted(seen_as_child) == list(range(1, n)), "every node in exactly one chain"
        # positions are seq_len + depth: depth is the node's ancestor count
        assert tree.depth[r].tolist() == (tree.mask[r].sum(-1) - 1).tolist()
        if case.topk == 1:  # the chain case: next_token i -> i+1, lower-triangular mask
            assert tree.next_token[r].tolist() == [*range(1, n), -1]
            assert torch.equal(tree.mask[r], torch.ones(n, n, dtype=torch.bool).tril())


def test_build_rejects_a_node_without_its_parent() -> None:
    with pytest.raises(ValueError, match=ORPHAN_ERROR):
        build_tree_reference(*orphan_tree_args())


# --- greedy verify ------------------------------------------------------------------------------


@CASES
@given(case=tree_cases())
def test_greedy_verify_walks_the_first_matching_child(case: TreeCase) -> None:
    tree = _tree(case)
    target = case.target_predict
    got = verify_tree_greedy_reference(tree.tokens, tree.next_token, tree.next_sibling,
                                       target, case.max_depth)
    assert got.accept_index.shape == (case.root.shape[0], case.max_depth + 1)
    for r in range(case.root.shape[0]):
        a = int(got.accept_len[r])
        path = got.accept_index[r].tolist()
        assert 0 <= a <= case.max_depth and path[0] == 0
        assert path[a + 1:] == [-1] * (case.max_depth - a)
        for last, node in pairwise(path[: a + 1]):
            kids = _children(tree, r, last)
            matching = [c for c in kids if int(tree.tokens[r, c]) == int(target[r, last])]
            assert matching and node == matching[0], f"row {r}: first match after {last}"
        last = path[a]
        stuck = not any(int(tree.tokens[r, c]) == int(target[r, last])
                        for c in _children(tree, r, last))
        assert a == case.max_depth or stuck, f"row {r}: stopped early at {last}"
        assert int(got.bonus[r]) == int(target[r, last])


# --- tree speculative sampling ------------------------------------------------------------------


def _one_hot(target: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(target, vocab).double()


@CASES
@given(case=tree_cases(max_batch=2))
def test_sampling_with_one_hot_targets_is_greedy(case: TreeCase) -> None:
    """A one-hot target distribution leaves the sampler no choice: at each node it must accept
    the first child carrying the target's token, i.e. do exactly what greedy verify does."""
    tree = _tree(case)
    greedy = verify_tree_greedy_reference(tree.tokens, tree.next_token, tree.next_sibling,
                                          case.target_predict, case.max_depth)
    vocab = int(max(case.target_predict.max(), tree.tokens.max())) + 1
    for r in range(case.root.shape[0]):
        sampled = verify_tree_sampling(
            tree.tokens[r].tolist(), tree.next_token[r].tolist(), tree.next_sibling[r].tolist(),
            _one_hot(case.target_predict[r], vocab), case.max_depth, seed=r, first_position=0)
        a = int(greedy.accept_len[r])
        assert sampled.nodes == greedy.accept_index[r, : a + 1].tolist()
        assert sampled.bonus == int(greedy.bonus[r])


def test_sampling_first_token_has_the_target_marginal() -> None:
    """Over many seeds the first emitted token (an accepted child, or the bonus at the root) is
    distributed as the root's target distribution p — including a child whose token p gives no
    mass (never emitted) and tokens no child carries (reached only through the residual)."""
    p_root = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0], dtype=torch.float64)
    #          node:  0  1  2  3  4  5
    tokens = [9, 1, 5, 0, 3, 2]     # root's children 1, 2, 3 carry tokens 1, 5 (p=0), 0
    next_token = [1, 4, -1, 5, -1, -1]
    next_sibling = [-1, 2, 3, -1, -1, -1]
    probs = torch.full((6, 10), 0.1, dtype=torch.float64)
    probs[0] = torch.cat([p_root, torch.zeros(4, dtype=torch.float64)])
    draws = 6000
    counts = torch.zeros(10)
    for seed in range(draws):
        out = verify_tree_sampling(tokens, next_token, next_sibling, probs, 2, seed, 0)
        first = tokens[out.nodes[1]] if len(out.nodes) > 1 else out.bonus
        counts[first] += 1
    assert counts[5] == 0 and counts[6:].sum() == 0, "a token without mass was emitted"
    expected = p_root[:5] * draws
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 30) is about 5e-6; the seeds are fixed, so not flaky
    assert chi2 < 30, (counts[:5].tolist(), expected.tolist(), chi2)
    assert math.isclose(float(counts.sum()), draws)


def test_sampling_follows_a_one_hot_child_deep() -> None:
    """A hand-made path: one-hot targets steering to the second sibling, then a leaf."""
    tokens = [9, 1, 2, 3, 4]        # root -> {1, 2}; 2 -> {3, 4}
    next_token = [1, -1, 3, -1, -1]
    next_sibling = [-1, 2, -1, 4, -1]
    probs = torch.zeros((5, 8), dtype=torch.float64)
    probs[0, 2] = probs[2, 4] = probs[4, 7] = 1.0
    probs[1, 0] = probs[3, 0] = 1.0
    for seed in range(20):
        out = verify_tree_sampling(tokens, next_token, next_sibling, probs, 3, seed, 5)
        assert out.nodes == [0, 2, 4] and out.bonus == 7
