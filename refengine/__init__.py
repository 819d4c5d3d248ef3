"""refengine: specgate's compact reference engine (the oracle and the first certified backend)."""

from refengine.config import EngineConfig, SamplingParams, SpecConfig
from refengine.engine import Engine, RequestOutput
from refengine.events import Event, FinishEvent, RetractEvent, TokenEvent
from refengine.memory.view import MemoryView, ReqKV

__all__ = [
    "Engine", "EngineConfig", "Event", "FinishEvent", "MemoryView", "ReqKV", "RequestOutput",
    "RetractEvent", "SamplingParams", "SpecConfig", "TokenEvent",
]
__version__ = "0.1.0"
