"""Retraction, judged after every step from the event stream and the memory view (backends
claiming ``memory_view``; docs/adapter.md, "Retraction"):

* R1 retract events match the view: a request still live after a step whose committed KV
  shrank in it (or that left the view) had a ``RetractEvent`` in that step; and a request with
  a ``RetractEvent`` holds no KV of its own after that step (a session turn keeps the prefix
  it inherited). A retraction the stream does not report, or one that frees nothing, breaks
  every client that accounts for resumption (prefill counts, latency, billing).
* R2 no overtaking: while a retracted request waits to be re-admitted, no request submitted
  after it is admitted for the first time. Its wait is then bounded by the requests already in
  the engine when it was submitted; a backend that re-queues it behind later arrivals starves
  it under steady load while outputs and memory stay right.

Admitted in a step: after it the request holds KV beyond what it inherited from its session,
or the step streamed it a token. A request the suite asked to abort is not watched (its KV may
go before its finish is reported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conformance.checks.invariants import kv_held
from conformance.contract import Event, MemoryView, RetractEvent, TokenEvent


@dataclass
class RetractionWatch:
    """Fed every submit and every step of one handle; ``observe`` returns what broke."""

    arrivals: dict[str, int] = field(default_factory=dict)  # rid -> submit order
    inherited: dict[str, int] = field(default_factory=dict)  # rid -> session prefix it reuses
    admitted: set[str] = field(default_factory=set)  # held KV of its own since its submit
    waiting: dict[str, int] = field(default_factory=dict)  # retracted, not back: rid -> step
    committed: dict[str, int] = field(default_factory=dict)  # per request, after the last step
    # Retractions while a request submitted after the victim waited for its first admission:
    # the cases where R2 could be broken.
    contested: int = 0
    submits: int = 0

    def submitted(self, rid: str, inherited: int) -> None:
        self.arrivals[rid] = self.submits
        self.submits += 1
        self.inherited[rid] = inherited
        self.admitted.discard(rid)
        self.waiting.pop(rid, None)
        self.committed.pop(rid, None)  # a reused rid: what it held before was another request's

    def _own(self, view: MemoryView, rid: str) -> int:
        """KV ``rid`` holds beyond the session prefix it inherited."""
        return max(kv_held(view, rid) - self.inherited[rid], 0)

    def observe(self, step: int, events: Sequence[Event], view: MemoryView,
                live: set[str]) -> str | None:
        """After step ``step``: ``live``, the requests submitted, not finished and not asked
        to abort."""
        retracted = {ev.rid for ev in events if isinstance(ev, RetractEvent)} & live
        streamed = {ev.rid for ev in events if isinstance(ev, TokenEvent)}
        before, self.committed = self.committed, {
            rid: kv.committed for rid, kv in view.requests.items()}
        problem = (self._unreported(before, retracted, live)
                   or self._unreleased(view, retracted))
        admitted = {rid for rid in live if self._own(view, rid) > 0} | streamed
        self.waiting = {rid: at for rid, at in self.waiting.items()
                        if rid in live and rid not in admitted}
        for rid in sorted(retracted):
            self.waiting[rid] = step
            self.contested += any(self.arrivals[other] > self.arrivals[rid]
                                  for other in live - self.admitted - retracted)
        problem = problem or self._overtaken(admitted - self.admitted - retracted)
        self.admitted |= admitted
        return problem

    def _unreported(self, before: dict[str, int], retracted: set[str],
                    live: set[str]) -> str | None:
        for rid in sorted(live - retracted):
            had, has = before.get(rid, 0), self.committed.get(rid, 0)
            if has < had:
                where = "left the memory view" if rid not in self.committed else f"now {has}"
                return (f"R1 retract events: request {rid!r} lost KV in this step (committed "
                        f"{had}, {where}) while live and unfinished, with no RetractEvent: a "
                        "request loses its KV only by a retraction the step reports")
        return None

    def _unreleased(self, view: MemoryView, retracted: set[str]) -> str | None:
        for rid in sorted(retracted):
            own = self._own(view, rid)
            if own:
                return (f"R1 retract events: request {rid!r} was reported retracted, but after "
                        f"the step it still holds {own} positions of KV of its own "
                        f"({view.requests[rid]}, inherited from its session: "
                        f"{self.inherited[rid]}): a retraction releases the request's KV")
        return None

    def _overtaken(self, fresh: set[str]) -> str | None:
        for rid in sorted(fresh, key=self.arrivals.__getitem__):
            older = sorted((r for r in self.waiting if self.arrivals[r] < self.arrivals[rid]),
                           key=self.arrivals.__getitem__)
            if older:
                victim = older[0]
                return (f"R2 no overtaking: request {rid!r} was admitted for the first time "
                        f"while {victim!r}, submitted before it and retracted at step "
                        f"{self.waiting[victim]}, waited to be re-admitted: a retracted request "
                        "goes back ahead of every request that arrived after it")
        return None
