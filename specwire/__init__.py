"""The wire types the reference engine and the conformance contract share: one definition each,
no dependencies (no torch), so the contract can re-export them while importing nothing of the
engine, and the engine speaks them natively without importing conformance."""

from specwire.events import Event, FinishEvent, FinishReason, RetractEvent, TokenEvent
from specwire.memory import MemoryView, ReqKV
from specwire.params import SamplingParams, SpecConfig

__all__ = ["Event", "FinishEvent", "FinishReason", "MemoryView", "ReqKV", "RetractEvent",
           "SamplingParams", "SpecConfig", "TokenEvent"]
