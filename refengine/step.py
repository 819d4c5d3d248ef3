"""StepResult: what one launched step produced, handed to ``OutputProcessor.resolve``.

Launch runs the forwards into slots schedule allocated; resolve changes request state (tokens,
finish, KV commit). Keeping the two apart is what lets a step be resolved after the next one
was launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.request import Req, ReqStatus
from refengine.speculative.accept import VerifyOutcome


@dataclass
class StepResult:
    """Per request of the batch, in batch order."""

    reqs: list[Req]
    tokens: list[list[int]]     # tokens to append, in order ([]: a prefill chunk mid-prompt)
    written: list[int]          # KV positions this step's forward wrote (extend steps)
    verify: VerifyOutcome | None = None  # a verify step: accepted paths, for commit and extend
    # Overlap scheduling: the step is resolved one engine step after its launch, and a request
    # retracted in between (its retraction count moved) or finished gets nothing from it.
    overlap: bool = False
    generations: list[int] | None = None  # each request's retraction count at launch

    def stale(self, i: int) -> bool:
        req = self.reqs[i]
        return self.overlap and (req.status is ReqStatus.FINISHED or (
            self.generations is not None and req.retractions != self.generations[i]))
