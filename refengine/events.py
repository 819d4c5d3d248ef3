"""What one scheduler iteration reports: new tokens, finishes, retractions (the wire types,
defined in ``specwire``, shared with the conformance contract)."""

from specwire.events import Event, FinishEvent, RetractEvent, TokenEvent

__all__ = ["Event", "FinishEvent", "RetractEvent", "TokenEvent"]
