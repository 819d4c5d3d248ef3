"""Streaming sessions: the KV a multi-turn conversation keeps between its turns.

A session's context is every finished turn's prompt and completion. Between turns the session
holds a request row whose first ``cached`` positions carry committed KV for that context: all of
it but the final token, whose KV no forward ever computed (``cached == len(context) - 1``,
under plain decoding and every speculative worker alike). A turn's request carries only its new
tokens; the engine puts the context before them and the turn takes over the row, so only what
follows the cached prefix is prefilled.

How a turn ends decides what the session keeps:

* finished (stop or length): the turn's prompt and output become the context; its committed KV
  becomes the cached prefix (the rest of its allocation is freed);
* aborted: the session rolls back to the previous turn (context and cached prefix as before; the
  KV the turn added is freed);
* retracted: the turn keeps the inherited prefix and its row (``KVManager.retract``), frees the
  rest and re-prefills from the prefix when readmitted, so the session is as before the turn.

Bad use raises ``ValueError`` naming the session: an unknown id, a second live turn, closing a
session whose turn is still live, opening an id twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refengine.memory.manager import KVManager
from refengine.memory.view import ceil_page
from refengine.request import Req


@dataclass
class Session:
    session_id: str
    context: list[int] = field(default_factory=list)  # finished turns' prompts and outputs
    row: int | None = None      # held between turns; a live turn holds it meanwhile
    cached: int = 0             # committed positions of ``context`` in ``row``
    turn: str | None = None     # rid of the live turn


class SessionStore:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self._sessions: dict[str, Session] = {}

    def open(self, session_id: str) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id: a non-empty string is needed, got {session_id!r}")
        if session_id in self._sessions:
            raise ValueError(f"session_id: session {session_id!r} is already open")
        self._sessions[session_id] = Session(session_id)

    def close(self, session_id: str) -> None:
        """Free everything the session holds."""
        session = self.get(session_id)
        if session.turn is not None:
            raise ValueError(f"session_id: session {session_id!r} still has a live turn "
                             f"{session.turn!r}; abort it or let it finish before closing")
        if session.row is not None:
            self.kv.free_kept(session.row, session.cached)
        del self._sessions[session_id]

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise ValueError(f"session_id: no open session {session_id!r} (open_session first)")
        return session

    def context(self, session_id: str) -> list[int]:
        """The tokens a new turn's prompt follows; refuses a second live turn."""
        session = self.get(session_id)
        if session.turn is not None:
            raise ValueError(f"session_id: session {session_id!r} already has a live turn "
                             f"{session.turn!r}; one turn at a time")
        return list(session.context)

    def begin_turn(self, session_id: str, req: Req) -> None:
        """``req`` (its prompt already prefixed with the context) takes over the session's
        row and cached prefix."""
        session = self.get(session_id)
        session.turn = req.rid
        if session.row is not None:
            self.kv.lend(req, session.row, session.cached)
            session.row = None

    def end_turn(self, req: Req) -> None:
        """The turn finished or was aborted: keep its KV for the session, or roll back."""
        assert req.session_id is not None
        session = self._sessions[req.session_id]
        session.turn = None
        if req.finish_reason == "abort":
            keep = req.cached_prefix  # back to the previous turn; its context is unchanged
        else:
            keep = req.kv_committed_len
            session.context = req.fill_ids
        session.row = self.kv.keep(req, keep)
        session.cached = keep if session.row is not None else 0

    def held(self) -> tuple[int, int]:
        """Slots and rows sessions hold between turns."""
        kept = [s for s in self._sessions.values() if s.row is not None]
        return (sum(ceil_page(s.cached, self.kv.page_size) for s in kept), len(kept))
