"""Tree speculative sampling: exactly lossless for temperature / top-k / top-p.

The draft is treated as a point mass (sglang's target-only scheme with both thresholds at 1).
At the current node, with target distribution ``p`` (after temperature, top-k, top-p), the
children's tokens are tried in sibling order with one coin ``u``: child j is accepted iff
``u`` falls in its slice ``[sum_{i<j} p(t_i), sum_{i<=j} p(t_i))`` — inverse-CDF sampling over
the (distinct) child tokens, so each is emitted with probability ``p(t_j)``. If no slice holds
``u`` (probability ``1 - sum p(t_i)``), the token is drawn from ``p`` with the children's tokens
removed and renormalised. Either way the emitted token has marginal ``p``; accepting a child
moves on to its children with a fresh coin. When the depth limit is reached the bonus is drawn
from ``p`` itself.

Randomness: every output position has its own generator seeded from (request seed, position),
so runs are reproducible and do not depend on batch composition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refengine.sampler import draw_generator


@dataclass
class SampledPath:
    nodes: list[int]   # accepted nodes, root first
    bonus: int         # the token drawn after the last accepted node


Residual = Callable[[torch.Tensor, list[int]], torch.Tensor]


def residual_without(p: torch.Tensor, rejected: list[int]) -> torch.Tensor:
    """``p`` with the rejected children's tokens removed (unnormalised): what makes the scheme
    exact."""
    residual = p.clone()
    residual[rejected] = 0.0
    return residual


def verify_tree_sampling(tokens: list[int], next_token: list[int], next_sibling: list[int],
                         probs: torch.Tensor, max_depth: int, seed: int,
                         first_position: int,
                         residual: Residual = residual_without) -> SampledPath:
    """One request's tree; ``probs [N, V]`` float64 is the target distribution after each node.

    ``probs`` must be on the CPU (the draws' generators are CPU ones, so every device draws
    the same tokens). ``first_position`` is the output index the first emitted token will
    take. ``residual`` gives the distribution the bonus is drawn from after rejections (a
    seam for the bug zoo's negative control; the default is the exact one).
    """
    node, nodes = 0, [0]
    for depth in range(max_depth + 1):
        gen = draw_generator(seed, first_position + depth)
        p = probs[node]
        coin = float(torch.rand((), generator=gen, dtype=torch.float64, device="cpu"))
        below = 0.0
        removed: list[int] = []
        child = next_token[node] if depth < max_depth else -1
        while child != -1:
            mass = float(p[tokens[child]])
            if coin < below + mass:
                break
            below += mass
            removed.append(tokens[child])
            child = next_sibling[child]
        if child == -1:
            rest = residual(p, removed)
            total = float(rest.sum())
            if total <= 0.0:  # every token with mass was a rejected child: cannot happen
                raise RuntimeError(f"empty residual after rejecting {removed}")
            bonus = int(torch.multinomial(rest / total, 1, generator=gen))
            return SampledPath(nodes, bonus)
        node = child
        nodes.append(node)
    raise AssertionError("unreachable: the depth limit always draws a bonus")
