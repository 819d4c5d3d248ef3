"""The worker hooks (capability ``worker_hooks``): phase traces and forced verify outcomes.

A backend that claims ``worker_hooks`` returns, from ``EngineHandle.worker_hooks()``, an object
with ``trace`` (a list of ``PhaseRecord``, one per phase of every speculative step) and
``force_accept(rid, drafts)`` (the next verifies accept exactly ``min(drafts, what the tree
holds)`` draft tokens for ``rid``, whatever the target says: the mock-worker technique, so
lifecycle edges happen on demand).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class PhaseRecord:
    """What a phase produced: its type name and every tensor field's shape."""

    phase: str                               # prefill | draft | verify | extend | install
    kind: str                                # e.g. DraftInput, VerifyInput, DraftExtendInput
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    rids: tuple[str, ...] = ()


@runtime_checkable
class WorkerHooks(Protocol):
    """What ``EngineHandle.worker_hooks()`` returns."""

    trace: list[PhaseRecord]

    def force_accept(self, rid: str, drafts: int) -> None:
        """The next verifies of ``rid`` accept ``min(drafts, what the tree holds)`` drafts."""
