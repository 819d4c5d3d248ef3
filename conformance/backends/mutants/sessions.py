"""Mutants of what a streaming session keeps from a turn: one that ended by a stop (only the
tokens or KV the next turn continues from are wrong), and one that memory pressure gives up
(the session rolls back as if the client had aborted it). Every KV count stays right (M1-M5
and the inherited-KV count hold)."""

from __future__ import annotations

from refengine import Engine
from refengine.events import Event
from refengine.output import OutputProcessor
from refengine.request import Req
from refengine.step import StepResult


class _StopTurnEndsWithEOS(OutputProcessor):
    def _release(self, req: Req) -> None:
        deferred = self._deferred is not None
        super()._release(req)
        if not deferred and req.session_id is not None and req.finish_reason == "stop":
            # BUG: the session records the turn as ending with EOS (a chat template's end of
            # turn) in place of the stop token or the token that completed a stop string.
            self.sessions.get(req.session_id).context[-1] = self.eos_token_id


class StopTurnEndsWithEOS(Engine):
    """A session turn that ends by a stop token or a stop string is kept in the session's
    context with EOS in place of its last token: the count, the KV and the output are right,
    but the next turn continues from a token the turn never produced."""

    output_class = _StopTurnEndsWithEOS


class _StopRunNotCompacted(OutputProcessor):
    def commit_run(self, req: Req, nodes: list[int], overlap: bool) -> None:
        if not overlap and self.finish_reason(req) == "stop":
            # BUG: "the request is done, its KV is dead": a run cut by a stop is committed
            # where the verify block wrote it, without moving the accepted path into place.
            self.kv.commit(req, len(nodes))
            self.kv.truncate(req, req.kv_committed_len)
            return
        super().commit_run(req, nodes, overlap)


class StopRunNotCompacted(Engine):
    """A verify step whose run ends by a stop commits the block as written instead of moving
    the accepted path into place (the request is finishing: its KV looks dead). The counts
    are right, a chain's path is in place anyway and a plain request never reads it again; a
    session's next turn after a tree's run attends to the KV of rejected branches."""

    output_class = _StopRunNotCompacted


class _AbortsRetractedSessionTurns(OutputProcessor):
    def resolve(self, result: StepResult, events: list[Event]) -> None:
        for req in list(self.scheduler.waiting):
            if req.retractions and req.cached_prefix:
                # BUG: "a turn over a kept prefix cannot be re-prefilled": the retracted turn is
                # finished as aborted, and its session rolls back to the previous turn.
                self.finish(req, "abort", events)
        super().resolve(result, events)


class AbortsRetractedSessionTurns(Engine):
    """A session turn that inherited KV is given up when memory pressure retracts it: it
    finishes 'abort' and its session rolls back, instead of re-prefilling over its kept prefix
    and resuming. Every count holds and the session looks like one whose client aborted that
    turn; no client did."""

    output_class = _AbortsRetractedSessionTurns
