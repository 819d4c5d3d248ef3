"""The oracle's own sampling law (``conformance.checks.sampling_law``) equals the engine's
sampler on the unmodified engine, so holding the engine to it is fair, while sharing none of its
code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.sampling_law import AmbiguousNucleus, target_law
from refengine.config import SamplingParams
from refengine.sampler import sampling_probs

VOCAB = 64


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.3, 2.5]),
       top_k=st.sampled_from([-1, 1, 2, 4, 17, VOCAB, VOCAB + 5]),
       top_p=st.sampled_from([0.05, 0.3, 0.6, 0.75, 0.95, 1.0]),
       ties=st.booleans())
def test_equals_the_engine_sampler(seed: int, temperature: float, top_k: int, top_p: float,
                                   ties: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 3
    if ties:  # float32 logits do tie: a coarse grid makes ties at the top-k boundary common
        logits = torch.round(logits)
    want = sampling_probs(logits, SamplingParams(temperature=temperature, top_k=top_k,
                                                 top_p=top_p))
    try:
        got = target_law(logits, temperature, top_k, top_p)
    except AmbiguousNucleus:
        assert ties  # only tied logits can tie at the cut
        return
    assert got.dtype == torch.float64 and got.shape == (VOCAB,)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-15)


def test_top_k_keeps_ties_and_top_p_keeps_the_most_likely() -> None:
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert (target_law(logits, 1.0, 2, 1.0) > 0).tolist() == [True, True, True, False]
    only = target_law(torch.tensor([5.0, 0.0, 0.0]), 1.0, -1, 1e-9)
    assert only.tolist() == [1.0, 0.0, 0.0]


def test_a_sampler_that_ignores_top_p_differs_from_the_law() -> None:
    """What the oracle's independence buys: the law keeps top-p when the engine drops it."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    engine_without_top_p = sampling_probs(logits, SamplingParams(temperature=0.8, top_p=1.0))
    law = target_law(logits, 0.8, -1, 0.6)
    assert int((law > 0).sum()) < int((engine_without_top_p > 0).sum())


def test_a_cut_between_equal_probabilities_is_refused() -> None:
    with pytest.raises(AmbiguousNucleus):
        target_law(torch.tensor([1.0, 1.0, 0.0]), 1.0, -1, 0.4)
    assert target_law(torch.tensor([1.0, 1.0, 0.0]), 1.0, -1, 0.8)[2] == 0.0  # both kept


def test_greedy_has_no_law() -> None:
    with pytest.raises(ValueError, match="temperature"):
        target_law(torch.zeros(4), 0.0, -1, 1.0)
