"""The reference oracle: the reference engine's plain greedy output, one request at a time, the
exact (float64) distribution a sampled request draws its next token from, and the judgment of
where a backend's greedy output first differs from the reference's.

Whatever backend is under test (a mutant of the reference engine included), expected outputs
come from the committed expected outputs or else from ``refengine.Engine`` with plain
decoding, so a broken backend can never vouch for itself.

Near-ties. A backend computing in another precision (or merely another order of float32 sums)
may pick the other token where the reference's top two logits are closer than its rounding
noise. A first divergence is a *near-tie* when the backend's token is within the ``epsilon`` of
its declared precision of the reference's top logit, at that very prefix (the outputs agree up
to it); anywhere else it is a failure. The caller picks the epsilon: float32's is fixed here,
a reduced precision's is calibrated on the reference (``conformance.checks.calibration``).
Past a near-tie nothing of that request can be compared: the backend continues a different
prefix.

Committed expected outputs. For the bundled fixture, greedy outputs come first from the
outputs committed with specgate (``conformance.checks.expected``), recorded once and checked against
transformers, not from the engine: when the code under test is ``refengine`` itself, a bug in
a path plain decoding shares with speculation would otherwise be in the oracle too. They are
recorded to cover every greedy request of the lossless, memory, lifecycle and worker tiers in
both profiles (prompts of the profiles' prompt sets, the long contexts around the context
boundaries, any length up to the recorded one, stop token ids, EOS). Not covered, and
answered by running the engine (``ReferenceOracle.fallbacks`` counts them): the sessions tier's
turns (their contexts grow from earlier outputs), requests with stop strings, prompts of other
tests, and any model other than a bundled fixture with recorded outputs. The engine's logits
are still read for the near-tie judgment of a divergence the committed data cannot settle (a
backend token other than the recorded runner-up, where the recorded top-2 margin is below the
epsilon), and for ``next_token_probs`` (the distribution and reproducibility tiers), whose
temperature / top-k / top-p processing is the oracle's own (``conformance.checks.sampling_law``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
from tokenizers import Tokenizer

from conformance.checks.expected import ExpectedOutputs, load_expected
from conformance.checks.sampling_law import target_law
from conformance.contract.finish import stop_string_index
from refengine import Engine, EngineConfig, SamplingParams
from refengine.data import resolve_model_dir

# Logits. float32: the epsilon, nine times the largest top-logit gap change the reference shows
# between prefill shapes, as other engines sum in other orders too. bfloat16 and float16: the
# ceiling of the allowance calibrated per run (``conformance.checks.calibration``), about twice
# the largest change of a top-5 logit gap the reference itself shows in that precision
# (docs/decisions.md, "Near-ties").
NEAR_TIE_EPSILON: dict[str, float] = {"float32": 1e-4, "float16": 0.1, "bfloat16": 1.0}


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``[..., vocab]`` logits: the top logit minus the second, how close the greedy
    choice is to a tie."""
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


@dataclass(frozen=True)
class Divergence:
    """Where a backend's greedy output first differs from the reference's."""

    index: int                # output index of the first difference
    got: int | None           # the backend's token there (None: its output ended)
    want: int | None          # the reference's token there (None: its output ended)
    margin: float | None      # the reference's top-2 logit margin there (None: a length)
    gap: float | None         # reference logit of ``want`` minus that of ``got``
    epsilon: float

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.gap < self.epsilon

    def describe(self) -> str:
        if self.got is None:
            return (f"got {self.index} tokens, expected more: the reference continues with "
                    f"{self.want}")
        if self.want is None:
            return (f"expected {self.index} tokens, got more: the backend continues with "
                    f"{self.got}")
        return (f"first divergence at output index {self.index}: got {self.got}, expected "
                f"{self.want}; reference top-2 margin {self.margin:.3g}, token {self.got} "
                f"{self.gap:.3g} below the top (near-tie epsilon {self.epsilon:g})")


class ReferenceOracle:
    def __init__(self, model: str = "tiny-code",
                 expected: ExpectedOutputs | Literal["bundled"] | None = "bundled") -> None:
        """``expected``: the committed outputs to answer from ("bundled": the model's own, if
        it has any; None: none, every request runs the engine)."""
        self.model = model
        self.expected = load_expected(model) if isinstance(expected, str) else expected
        self.fallbacks = 0  # greedy requests the committed outputs did not cover
        self._cache: dict[tuple[tuple[int, ...], SamplingParams], list[int]] = {}
        self._probs: dict[tuple[tuple[int, ...], float, int, float], torch.Tensor] = {}

    @cached_property
    def engine(self) -> Engine:
        """The unmodified reference engine, started only when something needs it: in float32
        on the CPU whatever device the backend under test runs on (certify --device), so every
        device is judged against one reference."""
        return Engine(EngineConfig(model=self.model, kv_pool_tokens=8192,
                                   max_running_requests=4, device="cpu", dtype="float32"))

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(resolve_model_dir(self.model) / "tokenizer.json"))

    def greedy(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int]:
        if not params.greedy:
            raise ValueError("temperature: the oracle gives greedy outputs only")
        key = (tuple(prompt_ids), params)
        if key not in self._cache:
            committed = (None if self.expected is None
                         else self.expected.greedy(tuple(prompt_ids), params))
            if committed is None:
                self.fallbacks += 1
                committed = self.engine.generate([list(prompt_ids)], params)[0].output_ids
            self._cache[key] = committed
        return self._cache[key]

    def divergence(self, prompt_ids: tuple[int, ...], params: SamplingParams, got: list[int],
                   epsilon: float) -> Divergence | None:
        """The first difference of ``got`` from the reference's greedy output, if any, with the
        reference's top-2 margin and gap there (scored only when the outputs differ)."""
        want = self.greedy(prompt_ids, params)
        index = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                     None)
        if index is None:
            if len(got) == len(want):
                return None
            shorter = min(len(got), len(want))
            return Divergence(shorter, got[shorter] if len(got) > shorter else None,
                              want[shorter] if len(want) > shorter else None, None, None,
                              epsilon)
        margin, gap = self._margin_and_gap(tuple(prompt_ids), want[:index + 1], got[index])
        return Divergence(index, got[index], want[index], margin, gap, epsilon)

    def _margin_and_gap(self, prompt_ids: tuple[int, ...], want: list[int], got: int
                        ) -> tuple[float, float]:
        """Where ``want`` (the reference's output up to the divergence) and ``got`` part: the
        reference's top-2 margin there and its logit of ``want[-1]`` minus that of ``got``.
        The committed outputs settle the verdict where they hold this prefix: the recorded
        runner-up is the margin below the top, any other token at least that much (the
        engine's logits then only give its exact gap). Elsewhere: the engine's logits."""
        found = None if self.expected is None else self.expected.lookup(prompt_ids)
        index = len(want) - 1
        recorded = found is not None and found.tokens[:len(want)] == tuple(want)
        if recorded and got == found.runner_up[index]:
            return found.margins[index], found.margins[index]
        logits = self.engine.next_token_logits(list(prompt_ids) + want[:-1])
        gap = (float(logits[want[-1]] - logits[got]) if 0 <= got < logits.shape[-1]
               else float("inf"))
        if recorded:
            return found.margins[index], max(gap, found.margins[index])
        return float(top2_margins(logits)), gap

    def decode(self, ids: list[int]) -> str:
        """The fixture tokenizer's text for ``ids`` (what a backend's finish text is cut from)."""
        return self._tokenizer.decode(list(ids))

    def finish_text(self, output_ids: list[int], stops: tuple[str, ...]) -> str:
        """The text a request that finished by ``stop`` with ``output_ids`` reports: its output
        decoded, cut just before the earliest of ``stops`` in it (wherever that one is listed),
        whole if none occurs (a stop token or EOS ended it)."""
        text = self.decode(output_ids)
        cut = stop_string_index(text, stops)
        return text if cut is None else text[:cut]

    def next_token_probs(self, prefix_ids: tuple[int, ...], params: SamplingParams
                         ) -> torch.Tensor:
        """``[vocab]`` float64: the distribution of the token after ``prefix_ids`` (prompt and
        output so far) under ``params``' temperature / top-k / top-p, from one scoring prefill
        (the processing is the oracle's own, ``checks/sampling_law.py``: a sampler bug in the
        engine under test is not in the law it is held to)."""
        if params.greedy:
            raise ValueError("temperature: next_token_probs needs a sampled request")
        # Only the shaping knobs matter (not seed or length), so requests share entries.
        key = (tuple(prefix_ids), params.temperature, params.top_k, params.top_p)
        if key not in self._probs:
            logits = self.engine.next_token_logits(list(prefix_ids))
            self._probs[key] = target_law(logits, params.temperature, params.top_k,
                                          params.top_p)
        return self._probs[key]
