"""Speculative shapes beyond a spec's named configurations, drawn.

The named configurations never vary, so a rule an engine keys on a shape (a tree of N = S + 1
nodes taken for a chain, a tree as wide as S·K) shows only where some check happens to run that
shape. ``drawn_configs`` gives a spec further legal shapes of its algorithm: for a spec with
trees, a tree of N = S + 1 nodes (S >= 2, so it can branch), one of N = S·K and a chain; for a
chain spec, chains of other lengths; then shapes drawn from every legal one, none of them
named. The draw is seeded by the spec's name: a profile always runs the same shapes, and a
check's id names its shape.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from conformance.plan.specs import SpecChoice
from refengine.config import SpecConfig

MAX_STEPS = 6  # S at most: a little past the named configurations' deepest
MAX_TOPK = 4   # k at most for a tree

Shape = tuple[int, int, int]  # (S, k, N)


def legal_shapes(tree: bool) -> list[Shape]:
    """Every chain (N = S + 1) up to ``MAX_STEPS``, and with ``tree`` every tree up to
    ``MAX_TOPK`` too (k >= 2 and 2 <= N <= 1 + k·S: ``SpecConfig``'s rule)."""
    chains = [(s, 1, s + 1) for s in range(1, MAX_STEPS + 1)]
    trees = [(s, k, n) for s in range(1, MAX_STEPS + 1) for k in range(2, MAX_TOPK + 1)
             for n in range(2, 2 + k * s)]
    return chains + (trees if tree else [])


# The classes a spec with trees draws one shape of first, in order: a tree of N = S + 1 nodes
# that can branch (S >= 2), a tree of N = S·k nodes, a chain.
TREE_CLASSES: tuple[Callable[[Shape], bool], ...] = (
    lambda t: t[1] > 1 and t[0] >= 2 and t[2] == t[0] + 1,
    lambda t: t[1] > 1 and t[2] == t[0] * t[1],
    lambda t: t[1] == 1,
)


def drawn_shapes(spec: SpecChoice, count: int) -> list[Shape]:
    """``count`` distinct legal shapes for ``spec`` (fewer where fewer are left), none of its
    named ones: for a spec with trees one of each ``TREE_CLASSES`` first, then any; [] for
    plain decoding."""
    named = [c for c in spec.configs if c is not None]
    if not named:
        return []
    tree = any(c.topk > 1 for c in named)
    taken = {(c.num_steps, c.topk, c.num_draft_tokens) for c in named}
    legal = [s for s in legal_shapes(tree) if s not in taken]
    rng = random.Random(spec.name)
    picked: list[Shape] = []
    for wanted in TREE_CLASSES if tree else ():
        pool = [s for s in legal if wanted(s) and s not in picked]
        if pool and len(picked) < count:
            picked.append(rng.choice(pool))
    rest = [s for s in legal if s not in picked]
    return picked + rng.sample(rest, min(count - len(picked), len(rest)))


def drawn_configs(spec: SpecChoice, count: int) -> tuple[SpecConfig, ...]:
    """``drawn_shapes`` as configurations: the spec's first named one (its algorithm, draft
    model and overlap) at each shape."""
    base = spec.configs[0]
    if base is None:
        return ()
    return tuple(replace(base, num_steps=s, topk=k, num_draft_tokens=n)
                 for s, k, n in drawn_shapes(spec, count))
