"""The kernel tier's inputs, shared with the project's unit tests: draft trees laid out as the
EAGLE drafter lays them out (``tree_cases``), an orphan selection every build-tree kernel must
reject, and a published greedy-verify vector. The kernel hook itself is
``conformance/contract/kernels.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refengine.kernels.tree_reference import Tree, build_tree_reference

__all__ = ["PublishedVector", "TreeCase", "published_greedy_vector",
           "tree_cases"]

@dataclass(frozen=True)
class TreeCase:
    """One batch of draft trees laid out as the EAGLE drafter lays them out (see
    ``tree_reference``), with the target's greedy predictions for verify.

    ``scores`` are path scores (products of per-step draft probabilities), so a child never
    scores above its parent; ``selected = select_candidates(scores, num_nodes)``.
    """

    topk: int
    steps: int
    num_nodes: int
    root: torch.Tensor            # [b]
    cand_tokens: torch.Tensor     # [b, C], C = k + (steps - 1) * k * k
    cand_parents: torch.Tensor    # [b, C]
    scores: torch.Tensor          # [b, C] float32
    selected: torch.Tensor        # [b, N - 1]
    target_predict: torch.Tensor  # [b, N] the target's argmax after each node
    max_depth: int

    def describe(self) -> str:
        b = self.root.shape[0]
        return (f"b={b} topk={self.topk} steps={self.steps} num_nodes={self.num_nodes} "
                f"max_depth={self.max_depth}")


# Draft probabilities with deliberate ties: 1.0 (a child scoring exactly its parent's score),
# repeated halves (siblings and cousins with equal scores). Exercise the stable tie rules.
_TIED_PROBS = (1.0, 0.5, 0.5, 0.25, 0.125)


def _draft(gen: torch.Generator, b: int, k: int, steps: int, vocab: int, tied: bool,
           distinct_siblings: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates as the drafter builds them: k children of the root, then per step the k*k
    children of the current beam (the k best of the previous step's children, stable)."""

    def probs(rows: int) -> torch.Tensor:  # [b, rows, k] per-parent top-k probs, descending
        if tied:
            pick = torch.randint(len(_TIED_PROBS), (b, rows, k), generator=gen)
            p = torch.tensor(_TIED_PROBS, dtype=torch.float32)[pick]
        else:
            p = torch.rand((b, rows, k), generator=gen, dtype=torch.float32)
            p = p / p.sum(-1, keepdim=True)
        return torch.sort(p, dim=-1, descending=True).values

    def tokens(rows: int) -> torch.Tensor:  # [b, rows * k]
        if distinct_siblings:  # top-k indices of one distribution are distinct
            t = torch.stack([torch.randperm(vocab, generator=gen)[:k]
                             for _ in range(b * rows)])
        else:
            t = torch.randint(vocab, (b * rows, k), generator=gen)
        return t.view(b, rows * k)

    beam_scores = probs(1).view(b, k)
    beam_flat = torch.arange(k).expand(b, k)
    scores, toks = [beam_scores], [tokens(1)]
    parents = [torch.full((b, k), -1, dtype=torch.int64)]
    offset = k
    for _ in range(1, steps):
        child = (beam_scores[:, :, None] * probs(k)).reshape(b, k * k)
        scores.append(child)
        toks.append(tokens(k))
        parents.append(beam_flat.repeat_interleave(k, dim=1))
        pick = torch.sort(-child, dim=-1, stable=True).indices[:, :k]
        beam_scores = torch.gather(child, 1, pick)
        beam_flat = offset + pick
        offset += k * k
    return torch.cat(toks, 1), torch.cat(parents, 1), torch.cat(scores, 1)


def _targets(gen: torch.Generator, tree: Tree, vocab: int, match: float) -> torch.Tensor:
    """The target's argmax after each node: with probability ``match`` (for a node with
    children) one child's token, so accepted paths of every length occur; else a random
    token (which may still match a child by chance)."""
    b, n = tree.tokens.shape
    target = torch.randint(vocab, (b, n), generator=gen)
    for r in range(b):
        for i in range(n):
            children = []
            c = int(tree.next_token[r, i])
            while c != -1:
                children.append(c)
                c = int(tree.next_sibling[r, c])
            if children and float(torch.rand((), generator=gen)) < match:
                pick = children[int(torch.randint(len(children), (), generator=gen))]
                target[r, i] = tree.tokens[r, pick]
    return target


def tree_cases(max_batch: int = 6, max_topk: int = 4, max_steps: int = 5,
               max_nodes: int = 16) -> Any:
    """A Hypothesis strategy of ``TreeCase``: batch 1..max_batch, top-k 1..max_topk, steps
    1..max_steps, num_nodes 2..min(1 + candidates, max_nodes). Hypothesis picks the shape, the
    tie regime and a seed; the seed drives the bulk draws (cheap, and still shrinks by shape)."""
    from hypothesis import strategies as st

    from refengine.kernels.tree_reference import select_candidates

    @st.composite
    def cases(draw: Any) -> TreeCase:
        b = draw(st.integers(1, max_batch))
        k = draw(st.integers(1, max_topk))
        # the largest shapes are drawn often on purpose: few examples run under the interpreter
        steps = draw(st.one_of(st.integers(1, max_steps), st.just(max_steps)))
        most = min(1 + k + (steps - 1) * k * k, max_nodes)
        n = draw(st.one_of(st.integers(2, most), st.just(most)))
        max_depth = draw(st.one_of(st.just(steps), st.integers(0, steps)))
        vocab = draw(st.integers(max(k, 2), 40))
        tied = draw(st.booleans())
        distinct = draw(st.sampled_from((True, True, True, False)))
        match = draw(st.sampled_from((0.5, 0.5, 0.9)))  # 0.9: long accepted paths
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        cand_tokens, cand_parents, scores = _draft(gen, b, k, steps, vocab, tied, distinct)
        selected = select_candidates(scores, n)
        root = torch.randint(vocab, (b,), generator=gen)
        tree = build_tree_reference(root, cand_tokens, cand_parents, selected)
        return TreeCase(k, steps, n, root, cand_tokens, cand_parents, scores, selected,
                        _targets(gen, tree, vocab, match), max_depth)

    return cases()


ORPHAN_ERROR = "request row 0: node 2 selected without its parent"


def orphan_tree_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build-tree arguments (root, cand_tokens, cand_parents, selected) whose selection holds
    candidate 4 without its parent, candidate 1: an implementation must raise ORPHAN_ERROR."""
    return (torch.tensor([9]), torch.tensor([[1, 2, 3, 4, 5, 6]]),
            torch.tensor([[-1, -1, 0, 0, 1, 1]]), torch.tensor([[0, 4]]))


@dataclass(frozen=True)
class PublishedVector:
    """sgl-kernel's greedy-verify test vector (sglang-eagle-v1-v2.md §5.3), in local node
    indices: sglang's ``accept_index`` holds global rows ``req * N + node``."""

    tokens: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    target_predict: torch.Tensor
    max_depth: int
    accept_index: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor


def published_greedy_vector() -> PublishedVector:
    target = torch.full((2, 6), 18, dtype=torch.int64)
    target[0, 0], target[0, 3], target[0, 4] = 3, 4, 5
    target[1, 0], target[1, 4] = 11, 12
    return PublishedVector(
        tokens=torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
        next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        target_predict=target, max_depth=3,
        accept_index=torch.tensor([[0, 3, 4, 5], [0, 4, 5, -1]]),
        accept_len=torch.tensor([3, 2]), bonus=torch.tensor([18, 18]))
