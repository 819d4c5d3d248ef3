"""What one engine step reports: new tokens, finishes, retractions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenEvent:
    """Tokens appended to ``rid``'s output in this step (several per verify under speculation)."""

    rid: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class FinishEvent:
    rid: str
    reason: FinishReason
    output_ids: tuple[int, ...]
    text: str = ""
    accept_lens: tuple[int, ...] = ()  # tokens emitted per verify step; () for plain decoding
    cached_tokens: int = 0  # prompt positions whose KV came from the session's earlier turns


@dataclass(frozen=True)
class RetractEvent:
    """``rid`` lost its KV under memory pressure; it keeps its output and re-prefills later."""

    rid: str


Event = TokenEvent | FinishEvent | RetractEvent
