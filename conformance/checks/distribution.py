"""Exact laws of sampled tokens, for the distribution tier.

* ``exact_law``: the target's joint law of the first few sampled tokens after a prompt, on its
  support (restricted by top-k), from the reference oracle's float64 next-token distributions.
* ``speculative_law``: the joint law of the first three tokens that a tree speculative sampler
  emits, given the draft trees it verified and its after-rejection ("bonus") law. With the
  correct residual it is the target law whatever the trees; with the negative control's bug
  (``biased_bonus``: the bonus drawn from ``p`` itself) it is the control's exact law, whose
  distance from the target gives the tier's power against it.

The tree sampling scheme (``refengine.speculative.verify``): at a node with target distribution
``p``
and children ``c_1..c_m`` (distinct tokens), child ``c_j`` is accepted with probability
``p(c_j)`` (one coin, inverse CDF over the children); otherwise (``1 - p(children)``) the bonus
is drawn from the after-rejection law and the step ends. Each output position has its own
generator, so successive nodes draw independently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

Cell = tuple[int, ...]
# A draft tree as the verifier saw it: (path of tokens below the root, children's tokens in
# sibling order) for every node, sorted; hashable, so identical trees count together.
DraftTree = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def draft_tree(tokens: list[int], next_token: list[int], next_sibling: list[int]) -> DraftTree:
    """The tree of one request's ``VerifyInput`` row, by tokens instead of node indices."""
    nodes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
    while stack:
        node, path = stack.pop()
        children = []
        child = next_token[node]
        while child != -1:
            children.append(child)
            child = next_sibling[child]
        nodes.append((path, tuple(tokens[c] for c in children)))
        stack.extend((c, (*path, tokens[c])) for c in children)
    return tuple(sorted(nodes))


Trees = dict[tuple[int, ...], Counter[DraftTree]]   # root sequence -> trees verified there
ProbsOf = Callable[[tuple[int, ...]], torch.Tensor]  # full sequence -> [vocab] float64
BonusLaw = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class JointLaw:
    """The exact law of the first ``tokens`` sampled tokens after ``prompt``, on its support
    (every cell of positive probability, in lexicographic order), with the next-token
    distributions it was built from (keyed by output prefix)."""

    prompt_id: str
    prompt: tuple[int, ...]
    tokens: int
    cells: tuple[Cell, ...]
    probs: np.ndarray                                  # float64, sums to 1
    next_probs: dict[tuple[int, ...], torch.Tensor]    # output prefix -> [vocab] float64

    def counts(self, outputs: Iterable[Iterable[int]]) -> np.ndarray:
        """Counts per cell plus a last cell for draws outside the support (probability 0,
        so a single one rejects)."""
        index = {c: i for i, c in enumerate(self.cells)}
        counts = np.zeros(len(self.cells) + 1)
        for out in outputs:
            counts[index.get(tuple(out)[:self.tokens], len(self.cells))] += 1
        return counts

    @property
    def probs_with_outside(self) -> np.ndarray:
        return np.append(self.probs, 0.0)

    @property
    def entropy_bits(self) -> float:
        p = self.probs[self.probs > 0]
        return float(-(p * np.log2(p)).sum())


class SupportTooLarge(Exception):
    """The joint law has more cells than the caller can test."""


def exact_law(probs_of: ProbsOf, prompt_id: str, prompt: tuple[int, ...], tokens: int,
              max_cells: int | None = None) -> JointLaw:
    """Walk the support tree: one next-token distribution per support prefix (``1 + k + k^2``
    for three tokens under top-k). With ``max_cells``, stop (``SupportTooLarge``) as soon as
    the walk has found more cells than that: a top-p support can be huge, and walking it
    costs one forward per prefix (every prefix walked leads to a cell, so stopping early
    bounds the forwards too)."""
    next_probs: dict[tuple[int, ...], torch.Tensor] = {}
    cells: list[Cell] = []
    masses: list[float] = []

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == tokens:
            if max_cells is not None and len(cells) == max_cells:
                raise SupportTooLarge(f"{prompt_id}: more than {max_cells} cells")
            cells.append(prefix)
            masses.append(mass)
            return
        p = probs_of(prompt + prefix)
        next_probs[prefix] = p
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk((*prefix, t), mass * float(p[t]))

    walk((), 1.0)
    return JointLaw(prompt_id, prompt, tokens, tuple(cells), np.array(masses), next_probs)


def verify_misapplied_law(law: JointLaw, verify_probs_of: ProbsOf) -> np.ndarray:
    """The law on ``law.cells`` plus a last cell for the rest (outside the target's support)
    of a speculative sampler that is exact but verifies against ``verify_probs_of`` instead of
    the target: t1 is plain (the prefill's own draw, from the target), t2 and t3 are verified,
    and an exact verify emits exactly its distribution whatever the drafts."""
    out = np.zeros(len(law.cells) + 1)
    for i, (t1, t2, t3) in enumerate(law.cells):
        q1 = verify_probs_of((*law.prompt, t1))
        q2 = verify_probs_of((*law.prompt, t1, t2))
        out[i] = float(law.next_probs[()][t1]) * float(q1[t2]) * float(q2[t3])
    out[-1] = max(0.0, 1.0 - float(out[:-1].sum()))
    return out


# --- the speculative sampler's law ------------------------------------------------------------

def reference_bonus(p: torch.Tensor, children: tuple[int, ...]) -> torch.Tensor:
    """The correct after-rejection law: ``p`` without the rejected children, renormalised.
    Written here again on purpose rather than imported from ``refengine.speculative.verify``: the
    oracle must not share code with the sampler it judges."""
    residual = p.clone()
    residual[list(children)] = 0.0
    total = float(residual.sum())
    return residual / total if total > 0 else residual


def biased_bonus(p: torch.Tensor, children: tuple[int, ...]) -> torch.Tensor:
    """The negative control's after-rejection law: ``p`` itself, rejected children included."""
    return p


def emission(p: torch.Tensor, children: tuple[int, ...], bonus: BonusLaw
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One node's emission law split into (accepted child, bonus) parts; they sum to the law
    of the emitted token."""
    accepted = torch.zeros_like(p)
    if children:
        accepted[list(children)] = p[list(children)]
    return accepted, (1.0 - float(accepted.sum())) * bonus(p, children)


def children_at(tree: DraftTree, path: tuple[int, ...], depth: int, max_depth: int
                ) -> tuple[int, ...]:
    """The children's tokens of the node at ``path`` below the root; none at the depth limit
    (the sampler draws the bonus there)."""
    if depth >= max_depth:
        return ()
    return dict(tree).get(path, ())


def variants(trees: Trees, root: tuple[int, ...]) -> list[tuple[DraftTree, float]]:
    """The trees verified at ``root`` with their frequencies; none recorded: no drafts (the
    node's law is then ``p`` under either bonus law)."""
    seen = trees.get(root)
    if not seen:
        return [((), 1.0)]
    total = sum(seen.values())
    return [(tree, n / total) for tree, n in sorted(seen.items())]


def speculative_law(law: JointLaw, trees: Trees, bonus: BonusLaw, max_depth: int
                    ) -> np.ndarray:
    """The law of (t1, t2, t3) on ``law.cells`` for the tree sampler with ``bonus`` as its
    after-rejection law. t1 is plain (the prefill); t2 is emitted at the root of the tree at
    (prompt, t1); t3 at t2's node of that tree if t2 was an accepted child, else (t2 was the
    bonus) at the root of the next tree, at (prompt, t1, t2). A root never recorded is taken
    to have had no drafts, which can only understate a bias."""
    if law.tokens != 3:
        raise ValueError(f"tokens: the law is derived for 3 tokens, got {law.tokens}")
    out = np.zeros(len(law.cells))
    for i, (t1, t2, t3) in enumerate(law.cells):
        p0, p1, p2 = law.next_probs[()], law.next_probs[(t1,)], law.next_probs[(t1, t2)]
        total = 0.0
        for tree, w in variants(trees, (*law.prompt, t1)):
            acc, rest = emission(p1, children_at(tree, (), 0, max_depth), bonus)
            if acc[t2] > 0:  # t2 an accepted draft: t3 from its node of the same tree
                a3, r3 = emission(p2, children_at(tree, (t2,), 1, max_depth), bonus)
                total += w * float(acc[t2]) * float(a3[t3] + r3[t3])
            if rest[t2] > 0:  # t2 the bonus: t3 from the next verify, rooted at t2
                nxt = 0.0
                for tree2, w2 in variants(trees, (*law.prompt, t1, t2)):
                    a3, r3 = emission(p2, children_at(tree2, (), 0, max_depth), bonus)
                    nxt += w2 * float(a3[t3] + r3[t3])
                total += w * float(rest[t2]) * nxt
        out[i] = float(p0[t1]) * total
    return out


def first_draft_accept_rate(law: JointLaw, trees: Trees, max_depth: int) -> float:
    """How often t2 is an accepted draft: how much of the verify path a run exercises."""
    rate = 0.0
    for t1 in sorted({c[0] for c in law.cells}):
        p1 = law.next_probs[(t1,)]
        for tree, w in variants(trees, (*law.prompt, t1)):
            children = list(children_at(tree, (), 0, max_depth))
            rate += float(law.next_probs[()][t1]) * w * float(p1[children].sum())
    return rate
