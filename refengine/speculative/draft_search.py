"""The search of one draft step, apart from how its forwards run.

``search`` (``chain_search`` for ``topk == 1``, ``beam_search`` above) takes the step's first
candidates, the draft's feature at the root and a ``DraftForward``, and does only tensor work
with shapes fixed by the batch size: no host sync, no data-dependent shape. So the same code
serves the eager draft (its forward builds a batch through the ``ModelRunner`` each time) and
the graph runner's draft loop (its forward reads static, bucket-padded buffers and can sit
inside a compiled region). Tree
assembly from the candidates (``select_candidates``, ``build_tree_reference``) stays outside:
it is where the verify tree's data-dependent structure is decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# One draft forward of a step: (step i, node tokens [b*w], their input features [b*w, H],
# ancestor mask [b, w, >= i*w] or None) -> (logits [b*w, V], predicted features [b*w, H]).
DraftForward = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor | None],
                        tuple[torch.Tensor, torch.Tensor]]


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, k, dim=-1)
    return top.values, top.indices


@dataclass
class Candidates:
    """Every node the beam search produced, flat per request in production order (step 1's
    ``k``, then ``k*k`` per later step): path score, token, and the flat index of its parent
    (-1: a child of the root)."""

    scores: torch.Tensor    # [b, M] float32
    tokens: torch.Tensor    # [b, M] int64
    parents: torch.Tensor   # [b, M] int64


LoopOutput = torch.Tensor | Candidates  # a chain's draft tokens [b, S], or a beam's candidates


def search(topk_p: torch.Tensor, topk_index: torch.Tensor, hidden: torch.Tensor, steps: int,
           forward: DraftForward) -> LoopOutput:
    """One draft step from its first candidates (``topk_p``/``topk_index`` ``[b, k]``, the
    draft's feature at the root ``hidden [b, H]``): the chain for ``k == 1``, else the beam."""
    if topk_index.shape[1] == 1:
        return chain_search(topk_index, hidden, steps, forward)
    return beam_search(topk_p, topk_index, hidden, steps, forward)


def chain_search(topk_index: torch.Tensor, hidden: torch.Tensor, steps: int,
                 forward: DraftForward) -> torch.Tensor:
    """``topk == 1``: ``steps - 1`` forwards along the single path -> the draft tokens
    ``[b, steps]``, one per step, without the root (the caller has it; a graph's copy of it is
    only an input). Each step's token is the argmax of its logits: the top-1 of their softmax
    without computing it."""
    tokens = [topk_index[:, 0]]
    features = hidden
    for i in range(1, steps):
        logits, features = forward(i, tokens[-1], features, None)
        tokens.append(torch.argmax(logits, dim=-1))
    return torch.stack(tokens, dim=1)


def beam_search(topk_p: torch.Tensor, topk_index: torch.Tensor, hidden: torch.Tensor,
                steps: int, forward: DraftForward) -> Candidates:
    """A beam of ``k`` nodes per request over ``steps - 1`` forwards. Step i's nodes see the
    committed prefix and (``node_mask``) the scratch entries of their ancestors and themselves;
    every child of every beam node becomes a candidate, and the ``k`` best paths by score
    (a stable sort: ties keep production order) form the next beam."""
    (b, k), device = topk_index.shape, topk_index.device
    scores = [topk_p]
    cand_tokens = [topk_index]
    cand_parents = [torch.full((b, k), -1, dtype=torch.int64, device=device)]
    beam_tokens, beam_scores = topk_index, topk_p
    beam_feat = hidden[:, None, :].expand(b, k, -1)
    beam_flat = torch.arange(k, device=device).expand(b, k)
    ancestors = torch.zeros((b, k, max(k * (steps - 1), 1)), dtype=torch.bool, device=device)
    offset = k
    own_entry = torch.eye(k, dtype=torch.bool, device=device)
    for i in range(1, steps):
        node_mask = ancestors.clone()
        node_mask[:, :, (i - 1) * k:i * k] |= own_entry
        logits, predicted = forward(i, beam_tokens.reshape(-1), beam_feat.reshape(b * k, -1),
                                    node_mask)
        child_p, child_tok = top_k(logits, k)                      # [b*k, k]
        child_scores = (beam_scores[:, :, None] * child_p.view(b, k, k)).reshape(b, k * k)
        scores.append(child_scores)
        cand_tokens.append(child_tok.view(b, k * k))
        cand_parents.append(beam_flat[:, :, None].expand(b, k, k).reshape(b, k * k))
        pick = torch.sort(-child_scores, dim=-1, stable=True).indices[:, :k]
        parent_slot = pick // k
        beam_tokens = torch.gather(child_tok.view(b, k * k), 1, pick)
        beam_scores = torch.gather(child_scores, 1, pick)
        beam_feat = torch.gather(predicted.view(b, k, -1), 1, parent_slot[:, :, None]
                                 .expand(-1, -1, predicted.shape[-1]))
        beam_flat = offset + pick
        ancestors = torch.gather(node_mask, 1, parent_slot[:, :, None]
                                 .expand(-1, -1, node_mask.shape[-1]))
        offset += k * k
    return Candidates(torch.cat(scores, dim=1), torch.cat(cand_tokens, dim=1),
                      torch.cat(cand_parents, dim=1))
