"""The chance of an honest collision (``conformance.checks.collisions``) on laws whose answer is
known: the estimate depends only on the law, never on a backend's streams."""

from __future__ import annotations

import pytest
import torch

from conformance.checks.collisions import COLLISION_DRAWS, collision_probability
from conformance.contract import SamplingParams

SAMPLED = SamplingParams(max_new_tokens=4, temperature=1.0)


class FixedLaw:
    """An oracle whose next-token law is the same after every prefix; counts what it is
    asked."""

    def __init__(self, law: list[float]) -> None:
        self.law = torch.tensor(law, dtype=torch.float64)
        self.asked = 0

    def next_token_probs(self, prefix: tuple[int, ...], params: SamplingParams
                         ) -> torch.Tensor:
        self.asked += 1
        return self.law


def test_a_uniform_law_gives_its_exact_collision_chance() -> None:
    """Every stream of 4 tokens over 8 equally likely ones has p = 8^-4: so has the mean."""
    oracle = FixedLaw([1 / 8] * 8)
    got = collision_probability(oracle, (1, 2), SAMPLED)  # type: ignore[arg-type]
    assert got == pytest.approx(8.0 ** -4)
    assert oracle.asked == (COLLISION_DRAWS + 1) * SAMPLED.max_new_tokens


def test_a_peaked_law_counts_its_likeliest_stream() -> None:
    """One token at 0.9: the likeliest stream alone makes the chance at least 0.9^8, whatever
    the draws met; and the estimate is the same every time."""
    oracle = FixedLaw([0.9, 0.05, 0.05])
    got = collision_probability(oracle, (1,), SAMPLED)  # type: ignore[arg-type]
    assert got >= 0.9 ** 8
    exact = sum(p * p for p in (0.9, 0.05, 0.05)) ** 4  # independent steps: a product
    assert got == pytest.approx(exact, rel=0.5)
    assert collision_probability(oracle, (1,), SAMPLED) == got  # type: ignore[arg-type]
