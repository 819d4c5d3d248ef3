"""The chance that two honest sampled streams coincide, from the reference oracle alone.

Two independent streams of ``n`` tokens drawn after one prompt coincide with probability
``sum_s p(s)^2``: the mean of ``p(s)`` over streams ``s`` drawn from ``p`` itself. The
reproducibility tier reads something into identical streams only where this is small. It is
estimated from streams the oracle draws from its own exact per-token law (``next_token_probs``),
never from the backend's: a backend that ignores its sampling settings emits the likeliest
stream every time, and an estimate from its streams would blame the model for the coincidence.

The estimate is the larger of the mean over ``draws`` streams (a fixed generator: the same
figure every run) and the square of the likeliest-path stream's probability (the stream of
each step's most likely token), a term of the sum itself, which a few draws can miss.
"""

from __future__ import annotations

import torch

from conformance.checks.oracle import ReferenceOracle
from conformance.contract import SamplingParams

COLLISION_DRAWS = 8


def _stream_probability(oracle: ReferenceOracle, prompt: tuple[int, ...],
                        params: SamplingParams, pick: torch.Generator | None) -> float:
    """``p(s | prompt)`` of one stream of ``params.max_new_tokens`` tokens: drawn from the
    oracle's law with ``pick``, or (None) each step's most likely token."""
    stream: list[int] = []
    prob = 1.0
    for _ in range(params.max_new_tokens):
        law = oracle.next_token_probs((*prompt, *stream), params)
        token = int(law.argmax() if pick is None else torch.multinomial(law, 1, generator=pick))
        prob *= float(law[token])
        stream.append(token)
    return prob


def collision_probability(oracle: ReferenceOracle, prompt: tuple[int, ...],
                          params: SamplingParams, draws: int = COLLISION_DRAWS) -> float:
    """The estimated ``sum_s p(s)^2`` for streams of ``params.max_new_tokens`` tokens after
    ``prompt`` under ``params``' temperature / top-k / top-p (its seed plays no part)."""
    pick = torch.Generator().manual_seed(0)
    mean = sum(_stream_probability(oracle, prompt, params, pick) for _ in range(draws)) / draws
    return max(mean, _stream_probability(oracle, prompt, params, None) ** 2)
