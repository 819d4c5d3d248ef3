"""Token selection: greedy argmax, or temperature / top-k / top-p sampling.

Sampled draws are reproducible per request and independent of batching: the generator for a
request's i-th output token is seeded from ``(request seed, i)``, so a retraction, a different
batch composition or a re-run gives the same draw for the same distribution.
"""

from __future__ import annotations

import zlib

import torch

from refengine.config import SamplingParams

_SEED_STRIDE = 1_000_003  # prime; keeps (seed, index) pairs apart for realistic lengths


def request_seed(engine_seed: int, rid: str) -> int:
    """The sampling seed of a request that gives none: from the engine's seed and its id."""
    return (engine_seed * 7919 + zlib.crc32(rid.encode())) % (2**31)


def draw_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed((seed * _SEED_STRIDE + index) % (2**63 - 1))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from, for each row of ``logits`` ([n, vocab]).

    Order as in HF: temperature, then top-k, then top-p (smallest prefix of the sorted
    distribution whose mass reaches top_p; the most likely token always stays).
    """
    x = logits.double() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_one(probs: torch.Tensor, seed: int, index: int) -> int:
    return int(torch.multinomial(probs, 1, generator=draw_generator(seed, index)))


def select_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  indices: list[int]) -> list[int]:
    """One token per row of ``logits``; ``indices[b]`` is the output position being drawn."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for b, p in enumerate(params):
        if not p.greedy:
            # The draw's generator is a CPU one (the same draws on every device): one copy of
            # the request's distribution to the host.
            tokens[b] = sample_one(sampling_probs(logits[b], p).cpu(), seeds[b], indices[b])
    return tokens
