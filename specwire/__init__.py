"""The wire types the reference engine and the conformance contract share: one definition each,
no dependencies (no torch), so the contract can re-export them while importing nothing of the
engine, and the engine speaks them natively without importing conformance.
``specwire.untrusted`` is the one bounded reader both use for files they did not write
(repro files, shards' reports, the compiled-key cache's sidecars)."""

from specwire.events import Event, FinishEvent, FinishReason, RetractEvent, TokenEvent
from specwire.memory import MemoryView, ReqKV
from specwire.params import SamplingParams, SpecConfig

__all__ = ["Event", "FinishEvent", "FinishReason", "MemoryView", "ReqKV", "RetractEvent",
           "SamplingParams", "SpecConfig", "TokenEvent"]
