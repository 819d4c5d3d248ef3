"""Component tables for mutants: the reference engine's drafter and draft-model tables with one
entry replaced, so a mutant names only what it breaks."""

from __future__ import annotations

from refengine import Engine
from refengine.engine import DraftClass, DrafterClass


def with_drafter(algorithm: str, drafter: DrafterClass) -> dict[str, DrafterClass]:
    """The reference engine's drafter table with ``algorithm``'s drafter replaced."""
    return {**Engine.drafter_classes, algorithm: drafter}


def with_draft(algorithm: str, draft: DraftClass) -> dict[str, DraftClass]:
    """The reference engine's draft-model table with ``algorithm``'s loader replaced."""
    return {**Engine.draft_classes, algorithm: draft}
