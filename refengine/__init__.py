"""refengine: specgate's compact reference engine (the oracle and the first certified backend)."""

from typing import TYPE_CHECKING

from refengine.config import EngineConfig, SamplingParams, SpecConfig
from refengine.events import Event, FinishEvent, RetractEvent, TokenEvent
from refengine.memory.view import MemoryView, ReqKV

if TYPE_CHECKING:
    from refengine.engine import Engine, RequestOutput

__all__ = [
    "Engine", "EngineConfig", "Event", "FinishEvent", "MemoryView", "ReqKV", "RequestOutput",
    "RetractEvent", "SamplingParams", "SpecConfig", "TokenEvent",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The engine imports torch (about a second): it loads on first use, so whatever needs only
    # the configuration and event types (the CLI's argument parsing, ``specgate --version``)
    # stays torch-free.
    if name in ("Engine", "RequestOutput"):
        from refengine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'refengine' has no attribute {name!r}")
