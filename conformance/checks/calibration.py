"""The near-tie allowance of a reduced precision, calibrated on the reference itself.

A backend that computes in bfloat16 or float16 may pick another token than the float32
reference where the reference's top logits nearly tie; how near is a property of the precision
and the model. So the allowance is measured, not assumed: the reference engine runs in that
precision over the calibration requests (the run's prompt set and long contexts), reading its
logits along the float32 reference's own greedy output (each position's prefix is the float32
output so far, as at a first divergence), and every position where it picks another token
than float32 is a divergence at the float32 margin between the two tokens there.

The allowance is ``CALIBRATION_FACTOR`` times the largest such margin (an engine summing in
another order rounds differently, by about as much), or times one unit of the precision's
rounding at the largest top logit if that is larger (no gap below it is resolved in that
precision, whether or not the calibration happened to meet one), and never more than the
precision's ceiling (``NEAR_TIE_EPSILON``). Computed once per process, precision and request
set, when a check first needs it (the shared comparison asks only once a reduced-precision
backend's output differs from the reference's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

import torch

from conformance.checks.oracle import NEAR_TIE_EPSILON, ReferenceOracle
from conformance.plan.profiles import Profile
from conformance.plan.requests import Requests, calibration_requests
from refengine import Engine

CALIBRATION_FACTOR = 2.0


@dataclass(frozen=True)
class Calibration:
    """What the reference in ``precision`` showed against itself in float32."""

    precision: str
    positions: int          # output positions read
    divergences: int        # of them, where it picked another token than float32
    largest_margin: float   # the largest float32 margin at such a position (0: none)
    resolution: float       # one unit of the precision's rounding at the largest top logit

    @property
    def allowance(self) -> float:
        measured = CALIBRATION_FACTOR * max(self.largest_margin, self.resolution)
        return min(measured, NEAR_TIE_EPSILON[self.precision])

    def describe(self) -> str:
        return (f"{self.precision} near-tie allowance {self.allowance:.3g}: "
                f"{CALIBRATION_FACTOR:g} x the larger of the largest margin at which the "
                f"reference in {self.precision} picks another token than in float32 "
                f"({self.largest_margin:.3g}; {self.divergences} of {self.positions} output "
                f"positions) and one unit of its rounding at the top logits "
                f"({self.resolution:.3g}), at most {NEAR_TIE_EPSILON[self.precision]:g}")


def resolution(precision: str, logit: float) -> float:
    """The spacing of ``precision``'s values at magnitude ``logit``."""
    eps = torch.finfo(getattr(torch, precision)).eps
    return eps * 2.0 ** math.floor(math.log2(logit)) if logit > 0 else eps


def calibrate(oracle: ReferenceOracle, precision: str, requests: Requests) -> Calibration:
    """The reference in ``precision`` along the float32 reference's greedy output of each of
    ``requests`` (greedy, every position scored in one prefill per request)."""
    if precision not in NEAR_TIE_EPSILON or precision == "float32":
        raise ValueError(f"precision: a reduced one of {sorted(NEAR_TIE_EPSILON)}, "
                         f"got {precision!r}")
    low = Engine(replace(oracle.engine.config, dtype=precision))
    positions = divergences = 0
    largest = top = 0.0
    for prompt, params in requests:
        want = oracle.greedy(tuple(prompt), params)
        ids = [*prompt, *want[:-1]]
        exact = oracle.engine.prompt_logits(ids)[len(prompt) - 1:].double()
        rounded = low.prompt_logits(ids)[len(prompt) - 1:].double()
        picked, other = exact.argmax(-1), rounded.argmax(-1)
        rows = (picked != other).nonzero().flatten()
        margins = exact[rows, picked[rows]] - exact[rows, other[rows]]
        positions += len(want)
        divergences += len(rows)
        largest = max([largest, *margins.tolist()])
        top = max(top, float(exact.max(-1).values.abs().max()))
    return Calibration(precision, positions, divergences, largest, resolution(precision, top))


@cache
def reference_calibration(model: str, precision: str, requests: Requests) -> Calibration:
    """``calibrate`` on an oracle of ``model`` of its own, once per process for each model,
    precision and request set: every suite check (and every suite run in one process) shares
    it."""
    return calibrate(ReferenceOracle(model), precision, requests)


def near_tie_allowance(model: str, precision: str, profile: Profile) -> float:
    """The near-tie bound for a backend declaring ``precision``: float32's fixed epsilon, or a
    reduced precision's allowance calibrated on ``profile``'s calibration requests. The one
    rule the suite's checks and the repro replay both judge by."""
    if precision == "float32":
        return NEAR_TIE_EPSILON[precision]
    return reference_calibration(model, precision,
                                 calibration_requests(model, profile)).allowance
