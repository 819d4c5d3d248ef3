"""The accept rule: which drafted tokens a verify keeps, and the bonus token after them.

This is the only place that decides it. Greedy requests walk the tree from the root, at each
node following the first child (in sibling order) whose token equals the target's argmax there,
for at most ``num_steps`` drafts; the bonus is the target's argmax after the last accepted node
(``kernels.tree_reference.greedy_walk``; on a GPU its Triton kernel, ``kernels.dispatch``; in a
graphed verify the graph itself walks, ``kernels.tree_static``, and the host reads the result).
Sampled requests use tree speculative sampling (``speculative.verify.verify_tree_sampling``):
each child is accepted with probability ``p/q``, a rejection draws from the residual, so every
emitted token follows the target's distribution exactly. ``sample_path`` is passed in so a
worker variant can replace the sampled rule alone. The result, a ``VerifyOutcome``, is what
resolve commits and draft-extend continues from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refengine.kernels.dispatch import GreedyLists, greedy_verify_lists, walk_lists
from refengine.request import Req
from refengine.sampler import sampling_probs
from refengine.speculative.inputs import DraftInput, SeedInput, VerifyInput
from refengine.speculative.verify import SampledPath


@dataclass
class VerifyOutcome:
    """Per request: accepted nodes (root first) and the tokens they emit (drafts + bonus).
    A step run as one graph (``refengine/graph/step_graph.py``) brings the drafter's next
    state instead of the features and tree its draft-extend would start from."""

    nodes: list[list[int]]
    emitted: list[list[int]]
    features: torch.Tensor | None       # [b, N, H] target features at every tree node
    verify_input: VerifyInput | None
    next_state: DraftInput | SeedInput | None = None  # every request's, from the graph


SamplePath = Callable[[Req, VerifyInput, int, torch.Tensor], SampledPath]


def accept(reqs: list[Req], verify_input: VerifyInput, logits: torch.Tensor, num_steps: int,
           sample_path: SamplePath, walk: torch.Tensor | None = None
           ) -> tuple[list[list[int]], list[list[int]]]:
    """``logits [b, N, V]`` of the verify forward -> per request the accepted block offsets
    (root first) and the tokens they emit (accepted drafts, then the bonus). ``walk``: the
    greedy walk the verify graph already made on the device (``kernels.tree_static``), used
    instead of walking here."""
    # Python lists once for the whole batch, in one transfer: per-element tensor reads cost
    # an op each (and a host sync each on a GPU).
    if walk is not None:
        walked = walk_lists(verify_input.draft_tokens, walk)
    else:
        walked = greedy_verify_lists(
            verify_input.draft_tokens, verify_input.retrieve_next_token,
            verify_input.retrieve_next_sibling, torch.argmax(logits, dim=-1), num_steps)
    draft_tokens = walked[0]
    paths, emitted = [], []
    for i, req in enumerate(reqs):
        if req.params.greedy:
            path, last = greedy_path(walked, i)
        else:
            # The draws use CPU generators: one copy of the request's distributions to the host.
            sampled = sample_path(req, verify_input, i,
                                  sampling_probs(logits[i], req.params).cpu())
            path, last = sampled.nodes, sampled.bonus
        paths.append(path)
        emitted.append(emitted_tokens(draft_tokens[i], path, last))
    return paths, emitted


def emitted_tokens(tokens: list[int], path: list[int], bonus: int) -> list[int]:
    """What a request's accepted ``path`` (root first) over its tree's ``tokens`` emits: the
    accepted drafts, then the bonus."""
    return [tokens[j] for j in path[1:]] + [bonus]


def greedy_path(walked: GreedyLists, i: int) -> tuple[list[int], int]:
    """Request ``i``'s accepted nodes (root first) and bonus token from a walk's lists."""
    _, accept_index, accept_len, bonus = walked
    return accept_index[i][: accept_len[i] + 1], bonus[i]


def walked_paths(tokens: torch.Tensor, walk: torch.Tensor
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """``accept``'s result for a batch of greedy requests whose walk a graph already made
    (``tokens [b, N]``: the verify tokens, root first; ``walk``: ``greedy_walk_static``'s)."""
    walked = walk_lists(tokens, walk)
    paths = [greedy_path(walked, i) for i in range(len(walked[0]))]
    return ([path for path, _ in paths],
            [emitted_tokens(row, path, bonus) for row, (path, bonus) in zip(walked[0], paths,
                                                                           strict=True)])
