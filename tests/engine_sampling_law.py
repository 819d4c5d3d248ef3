"""A pytest plugin for this project's tests only (``-p engine_sampling_law``): the suite's oracle
shaping sampled laws with the engine's own ``refengine.sampler.sampling_probs``, as it did
before it had a rule of its own. tests/test_source_mutants.py shows with it what the oracle's
independence defends against."""

from __future__ import annotations

import pytest
import torch

import conformance.checks.oracle


def _engine_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                ) -> torch.Tensor:
    from refengine.config import SamplingParams
    from refengine.sampler import sampling_probs

    return sampling_probs(logits, SamplingParams(temperature=temperature, top_k=top_k,
                                                 top_p=top_p))


def pytest_configure(config: pytest.Config) -> None:
    conformance.checks.oracle.target_law = _engine_law  # type: ignore[assignment]
