"""Mutants that show only near the model's context limit (``max_position_embeddings``)."""

from __future__ import annotations

from refengine import Engine
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req

SHORT_BY = 2  # tokens the broken length check ends a request before the limit


class _EndsShortOfLimit(OutputProcessor):
    def finish_reason(self, req: Req) -> FinishReason | None:
        reason = super().finish_reason(req)
        if reason is None and req.seq_len >= self.max_context_len - SHORT_BY:
            return "length"  # BUG: the limit check counts positions the request never uses
        return reason


class EndsShortOfContextLimit(Engine):
    """The length check at the context limit is off by a few tokens: a request that runs to
    ``max_position_embeddings`` ends, by length, two tokens short of it."""

    output_class = _EndsShortOfLimit
