"""The reference oracle: the reference engine's plain greedy output, one request at a time.

Whatever backend is under test (a mutant of the reference engine included), expected outputs
come from an unmodified ``refengine.Engine`` with plain decoding, so a broken backend can never
vouch for itself.
"""

from __future__ import annotations

from refengine import Engine, EngineConfig, SamplingParams


class ReferenceOracle:
    def __init__(self, model: str = "tiny-code") -> None:
        self.engine = Engine(EngineConfig(model=model, kv_pool_tokens=8192,
                                          max_running_requests=4))
        self._cache: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}

    def greedy(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int]:
        if not params.greedy:
            raise ValueError("temperature: the oracle gives greedy outputs only")
        key = (tuple(prompt_ids), params)
        if key not in self._cache:
            self._cache[key] = self.engine.generate([list(prompt_ids)], params)[0].output_ids
        return self._cache[key]
