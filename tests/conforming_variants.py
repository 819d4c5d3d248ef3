"""Test-only backends that model what the adapter contract allows a backend to do differently
from the reference engine, each the reference engine behind an adapter that changes one
thing. The suite must certify every one of them with no failed check: a check whose
precondition such a backend cannot meet is not applicable (or gated on a capability it does
not claim), never failed (``tests/test_conforming_variants.py``).

Named on the command line as ``--backend tests.conforming_variants:<factory>``:

* ``whole_prefill``: prefills every prompt whole and streams its first token in the same
  step; does not claim ``chunked_prefill`` (``max_prefill_tokens`` is ignored);
* ``run_to_completion``: one ``step()`` runs everything submitted to completion (not
  ``stepwise``; no abort, memory view, sessions or anything else that acts between steps);
* ``no_memory_view``: stepwise, but keeps its KV accounting to itself (no ``memory_view``;
  the pool and page size it is asked for are ignored).
"""

from __future__ import annotations

from dataclasses import replace

from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import Capabilities, Event, FinishEvent, MemoryView, OpenConfig, Request

# Larger than any prompt and any batch of them: every prompt is prefilled whole, in one step.
UNLIMITED_PREFILL = 1 << 30


class WholePrefillBackend(RefEngineBackend):
    name = "variant:whole_prefill"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), chunked_prefill=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"chunked_prefill": "every prompt is prefilled whole, in the step that admits it"}

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        return super().open(replace(cfg, max_prefill_tokens=UNLIMITED_PREFILL))


class NoMemoryViewHandle(RefEngineHandle):
    def memory(self) -> MemoryView:
        raise NotImplementedError("this backend keeps its KV accounting to itself")


class NoMemoryViewBackend(RefEngineBackend):
    name = "variant:no_memory_view"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), memory_view=False)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {"memory_view": "the KV pool is internal: no per-request accounting to show"}

    def open(self, cfg: OpenConfig) -> NoMemoryViewHandle:
        handle = super().open(replace(cfg, kv_pool_tokens=None, page_size=None))
        return NoMemoryViewHandle(handle.engine)


class RunToCompletionHandle(RefEngineHandle):
    """``step()`` runs the engine until every request submitted so far has finished."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.unfinished: set[str] = set()

    def submit(self, req: Request) -> None:
        super().submit(req)
        self.unfinished.add(req.rid)

    def step(self) -> list[Event]:
        events: list[Event] = []
        while self.unfinished:
            for event in self.engine.step():
                events.append(event)
                if isinstance(event, FinishEvent):
                    self.unfinished.discard(event.rid)
        return events


NOT_BETWEEN_STEPS = "one step() runs every request to completion: nothing happens between steps"


class RunToCompletionBackend(RefEngineBackend):
    name = "variant:run_to_completion"
    BETWEEN_STEPS = ("stepwise", "abort", "memory_view", "sessions", "forced_retract",
                     "in_flight", "worker_hooks", "graph_runner", "chunked_prefill")

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), kernels=False,
                       **dict.fromkeys(self.BETWEEN_STEPS, False))

    def unclaimed_reasons(self) -> dict[str, str]:
        return {**dict.fromkeys(self.BETWEEN_STEPS, NOT_BETWEEN_STEPS),
                "kernels": "its kernels are not handed out"}

    def open(self, cfg: OpenConfig) -> RunToCompletionHandle:
        return RunToCompletionHandle(super().open(cfg).engine)


def whole_prefill() -> WholePrefillBackend:
    return WholePrefillBackend()


def no_memory_view() -> NoMemoryViewBackend:
    return NoMemoryViewBackend()


def run_to_completion() -> RunToCompletionBackend:
    return RunToCompletionBackend()


class ClaimsChunkedPrefillWithout(WholePrefillBackend):
    """Not a conforming variant: claims ``chunked_prefill`` and prefills whole anyway. The
    check that needs the claim must fail it."""

    name = "variant:claims_chunked_prefill_without"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), chunked_prefill=True)

    def unclaimed_reasons(self) -> dict[str, str]:
        return {}


def claims_chunked_prefill_without() -> ClaimsChunkedPrefillWithout:
    return ClaimsChunkedPrefillWithout()
