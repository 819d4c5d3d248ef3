"""The suite's profiles: how much of each tier runs (``--specgate-profile``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Profile:
    """How much of each tier runs: ``gate`` for every CI run, ``full`` for certification."""

    name: str
    prompt_set: str
    max_new_tokens: int
    # Context lengths that long requests cross (engines size buffers so); one at or past the
    # model's context limit becomes a request that ends there.
    context_boundaries: tuple[int, ...]
    fuzz_examples: int  # the fuzz tier's state-machine examples per spec
    fuzz_shrink_seconds: float  # how long it may shrink a failure (inside the case timeout)
    # The configurations the memory tier's pressure runs open: every one of the spec, or only
    # the one with the largest per-step KV need (``conformance.run.pressure``).
    pressure_configs: Literal["all", "widest"]
    # Speculative shapes beyond the spec's named configurations the lossless tier runs
    # (``conformance.plan.shapes``).
    drawn_shapes: int
    # Seconds each phase of a check may take by default (times the graph executor's factor):
    # far above the slowest gate check on a busy machine (docs/measurements.md), so load does
    # not trip the limit.
    case_timeout: float


PROFILES = {
    "gate": Profile("gate", "small", 32, (512,), fuzz_examples=5,
                    fuzz_shrink_seconds=90, pressure_configs="widest", drawn_shapes=3,
                    case_timeout=300.0),
    "full": Profile("full", "default", 64, (512, 1024, 2048), fuzz_examples=100,
                    fuzz_shrink_seconds=300, pressure_configs="all", drawn_shapes=6,
                    case_timeout=1200.0),
}
