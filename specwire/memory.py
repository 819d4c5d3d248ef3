"""``MemoryView``: a backend's KV accounting (slots and request rows), as a step leaves it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ReqKV:
    """KV held by one live request, in tokens.

    ``committed``: positions with valid KV. ``allocated``: positions with a reserved slot.
    ``phase``: "prefill" while the prompt (or a retracted request's re-prefill) is still being
    written; "decode" afterwards.
    """

    committed: int
    allocated: int
    phase: Literal["prefill", "decode"] = "decode"


@dataclass(frozen=True)
class MemoryView:
    capacity: int
    free: int
    held: int
    page_size: int
    requests: Mapping[str, ReqKV] = field(default_factory=dict)
    rows_capacity: int = 0
    rows_free: int = 0
    rows_held: int = 0
    reserve_bound: int = 0
