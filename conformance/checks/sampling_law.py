"""The law a sampled request draws its next token from, written without the engine's code.

The adapter contract (``docs/adapter.md``) fixes the processing of a sampled request's logits
in HF's order: divide by the temperature, keep the tokens whose logit is at least the k-th
largest (top-k; ties at the k-th value stay), softmax, then keep the smallest most-likely
prefix whose mass reaches top-p (every token whose mass before it, most likely first, is below
top_p: the most likely token always stays) and renormalise. Where that cut falls between two
tokens of exactly equal probability the rule does not say which stays (an engine's sort
decides), so the law refuses (``AmbiguousNucleus``) rather than guess.

This is the oracle's own statement of that rule, in NumPy float64. It deliberately does not
call ``refengine.sampler.sampling_probs``: when specgate gates a change to the reference engine,
a sampler bug shared by plain decoding and verification would otherwise be in the oracle's law
too, and the distribution tier would find the engine in perfect agreement with itself
(``tests/test_sampling_law.py`` holds the two equal on the unmodified engine).
"""

from __future__ import annotations

import numpy as np
import torch


class AmbiguousNucleus(ValueError):
    """The top-p cut falls between tokens of exactly equal probability."""


def target_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
               ) -> torch.Tensor:
    """``[vocab]`` float64 probabilities for one row of ``logits`` under a sampled setting
    (``temperature`` > 0; ``top_k`` <= 0 and ``top_p`` >= 1 switch those filters off)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampled law, got {temperature}")
    x = logits.detach().to(torch.float64).cpu().numpy().reshape(-1) / temperature
    if 0 < top_k < x.size:
        kth = np.partition(x, x.size - top_k)[x.size - top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        ranked = p[order]
        mass_before = np.cumsum(ranked) - ranked
        inside = mass_before < top_p
        if not inside.all() and ranked[~inside][0] == ranked[inside][-1]:
            # which of two equally likely tokens the nucleus ends with is the sort's choice,
            # not the rule's: no law to hold an engine to
            raise AmbiguousNucleus(f"top-p {top_p} ends between tokens of equal probability "
                                   f"{ranked[inside][-1]:.6g}")
        kept = np.zeros_like(p)
        keep = order[inside]
        kept[keep] = p[keep]
        p = kept / kept.sum()
    return torch.from_numpy(p)
