"""Memory pressure, judged from outside any backend: which configuration of a spec needs the
most KV per step (the one the gate puts under pressure), and whether a run really put a
backend's KV pool under pressure.

The per-step KV need of a configuration (``step_kv_need``), from the ``SpecConfig`` alone: the
positions past its committed end that one request may hold while a decode step runs.

* plain decoding: 1 (the new token);
* a sequential speculative step: the verify block (``num_draft_tokens``) or the draft scratch,
  whichever is longer. The scratch is bounded by the draft tree: ``topk`` candidates at each of
  ``num_steps`` levels (EAGLE writes all but the last level; a frozen-KV drafter writes none,
  a draft model writes into the verify block), so a tree whose levels hold more than its verify
  block (EAGLE's (S=5, k=8, N=16)) needs more than N;
* overlap scheduling: the reservation held between steps, ``1 + 2L`` with ``L`` the longer of
  the two above (the committed length lags by up to L, and the step being launched needs up to
  L more).

Pressure (``PressureWitness``): a backend may meet a pool too small for its load by retracting
requests or by queueing them (admitting fewer until memory frees); the adapter contract allows
both. A run was under pressure when it retracted a request, or when after some step a request
it had submitted (and not aborted) waited holding no KV (left out of the memory view, or
listed there with zero KV) while the pool's free slots could not hold that request's whole
context (prompt plus ``max_new_tokens``, up to the context limit). A pool big enough for every
request at once meets neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conformance.checks.invariants import kv_held
from conformance.contract import MemoryView, SpecConfig


def step_kv_need(config: SpecConfig | None) -> int:
    """Positions past its committed end one request may hold during a decode step under
    ``config`` (None: plain decoding); see the module docstring."""
    if config is None:
        return 1
    reach = max(config.num_draft_tokens, config.topk * config.num_steps)
    return 1 + 2 * reach if config.overlap else reach


def widest_config(configs: Sequence[SpecConfig | None]) -> SpecConfig | None:
    """The configuration with the largest ``step_kv_need`` (the first of equals)."""
    return max(configs, key=step_kv_need)


@dataclass
class PressureWitness:
    """Watches a run step by step: ``needs`` maps each request to its whole context (prompt
    plus ``max_new_tokens``, up to the context limit)."""

    needs: dict[str, int]
    queued_steps: int = 0  # steps after which a request waited that the free pool could not hold
    aborted: set[str] = field(default_factory=set)  # asked to abort: no longer waiting to run

    def observe(self, view: MemoryView, live: set[str]) -> None:
        """After a step: ``view`` is the backend's memory view, ``live`` the requests
        submitted and not finished."""
        waiting = [rid for rid in live - self.aborted if kv_held(view, rid) == 0]
        if any(self.needs[rid] > view.free for rid in waiting):
            self.queued_steps += 1

    def applied(self, retractions: int) -> bool:
        return retractions > 0 or self.queued_steps > 0
