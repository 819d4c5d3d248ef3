"""The reference oracle: the reference engine's plain greedy output, one request at a time, and
the exact (float64) distribution a sampled request draws its next token from.

Whatever backend is under test (a mutant of the reference engine included), expected outputs
come from an unmodified ``refengine.Engine`` with plain decoding, so a broken backend can never
vouch for itself.
"""

from __future__ import annotations

import torch

from refengine import Engine, EngineConfig, SamplingParams
from refengine.sampler import sampling_probs


class ReferenceOracle:
    def __init__(self, model: str = "tiny-code") -> None:
        self.engine = Engine(EngineConfig(model=model, kv_pool_tokens=8192,
                                          max_running_requests=4))
        self._cache: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}
        self._probs: dict[tuple[tuple[int, ...], float, int, float], torch.Tensor] = {}

    def greedy(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int]:
        if not params.greedy:
            raise ValueError("temperature: the oracle gives greedy outputs only")
        key = (tuple(prompt_ids), params)
        if key not in self._cache:
            self._cache[key] = self.engine.generate([list(prompt_ids)], params)[0].output_ids
        return self._cache[key]

    def decode(self, ids: list[int]) -> str:
        """The fixture tokenizer's text for ``ids`` (what a backend's finish text is cut from)."""
        return self.engine.tokenizer.decode(list(ids))

    def next_token_probs(self, prefix_ids: tuple[int, ...], params: SamplingParams
                         ) -> torch.Tensor:
        """``[vocab]`` float64: the distribution of the token after ``prefix_ids`` (prompt and
        output so far) under ``params``' temperature / top-k / top-p, from one scoring prefill
        (the processing is the engine's own ``sampling_probs``, so the support matches)."""
        if params.greedy:
            raise ValueError("temperature: next_token_probs needs a sampled request")
        # Only the shaping knobs matter (not seed or length), so requests share entries.
        key = (tuple(prefix_ids), params.temperature, params.top_k, params.top_p)
        if key not in self._probs:
            logits = self.engine.next_token_logits(list(prefix_ids))
            self._probs[key] = sampling_probs(logits, params)
        return self._probs[key]
