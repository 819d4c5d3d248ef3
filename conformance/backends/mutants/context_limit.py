"""Mutants that show only near the model's context limit (``max_position_embeddings``)."""

from __future__ import annotations

from typing import ClassVar

from refengine import Engine
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req


class _EndsShortOfLimit(OutputProcessor):
    short_by: ClassVar[int] = 2  # tokens the broken length check ends a request before the limit

    def finish_reason(self, req: Req) -> FinishReason | None:
        reason = super().finish_reason(req)
        if reason is None and req.seq_len >= self.max_context_len - self.short_by:
            return "length"  # BUG: the limit check counts positions the request never uses
        return reason


class _EndsFarShortOfLimit(_EndsShortOfLimit):
    short_by = 64


class EndsShortOfContextLimit(Engine):
    """The length check at the context limit is off by a few tokens: a request that runs to
    ``max_position_embeddings`` ends, by length, two tokens short of it."""

    output_class = _EndsShortOfLimit


class EndsFarShortOfContextLimit(Engine):
    """The context limit taken as a reserve short of ``max_position_embeddings``: a request
    that runs to the limit ends, by length, 64 tokens before it (a request whose prompt is
    already that close ends after its first token)."""

    output_class = _EndsFarShortOfLimit
