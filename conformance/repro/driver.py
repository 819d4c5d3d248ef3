"""Driver: runs requests through an EngineHandle and checks every step from outside.

After each ``step()`` it checks the event stream (tokens only for live requests, one finish per
request, finish output == the tokens streamed, a finish ``abort`` only for a request the
suite aborted: the contract has no other abort) and, when the backend claims ``memory_view``,
that the view's pages are the size its ``config`` asked, the memory invariants M1-M3, and
whenever nothing is live, M4 (and M5 once no session is open); and that retractions are
reported and not overtaken (R1, R2: ``conformance.checks.retraction``). For
a streaming session's turn it knows the whole context (earlier turns' prompts and outputs, then
the turn's new tokens) and checks the inherited KV the turn reports: exactly the context before
it minus its final token, the previous turn's completion included. A run that stops making
progress fails instead of hanging.

The driver also keeps what it did (``actions``, with the ``config`` its handle was opened
with): the run of a repro file (``conformance.repro.scenario``), so a failing check can hand
back a scenario that replays it.

Every call into the backend goes through ``backend_call``: an exception it raises (or the case
timeout's, while it runs) carries a note naming the call, e.g. ``during handle.step() call 7;
live requests: [...]``, so a failure says which call of the backend failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

from conformance.checks.invariants import (
    InvariantError,
    check_busy,
    check_idle,
    page_size_error,
)
from conformance.checks.retraction import RetractionWatch
from conformance.contract import (
    Capabilities,
    EngineHandle,
    Event,
    FinishEvent,
    MemoryView,
    OpenConfig,
    Request,
    RetractEvent,
    SamplingParams,
    TokenEvent,
)
from conformance.plan.usage import CaseTimeout
from conformance.repro.scenario import (
    Abort,
    Action,
    CloseSession,
    OpenSession,
    Run,
    Step,
    Submit,
)


@contextmanager
def backend_call(what: str) -> Iterator[None]:
    """Name the backend call on whatever it raises, or on the case timeout hitting inside it
    (the exception keeps its type: a check expecting a ValueError still gets one)."""
    try:
        yield
    except (Exception, CaseTimeout) as err:
        err.add_note(f"during {what}")
        raise


@dataclass
class Outcome:
    rid: str
    output_ids: list[int]
    reason: str
    text: str
    accept_lens: list[int]
    cached_tokens: int = 0


@dataclass
class Driver:
    handle: EngineHandle
    caps: Capabilities
    overlap: bool = False   # the handle runs overlap scheduling (M3 allows the pre-claimed slot)
    steps: int = 0
    retractions: int = 0
    prompt_lens: dict[str, int] = field(default_factory=dict)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    retracted: Counter[str] = field(default_factory=Counter)  # RetractEvents per request
    aborted: set[str] = field(default_factory=set)  # asked to abort since their last submit
    contexts: dict[str, list[int]] = field(default_factory=dict)  # open session -> context
    turns: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # rid -> (session,
    #                                                                        full prompt)
    config: OpenConfig | None = None  # what the handle was opened with (for the repro)
    actions: list[Action] = field(default_factory=list)  # every call, in order
    view: MemoryView | None = None  # the memory view after the last step (memory_view)
    retraction: RetractionWatch = field(default_factory=RetractionWatch)  # R1, R2

    def _log(self, action: Action) -> None:
        """Note an action before making it (a call that raises is in the repro); consecutive
        steps are one ``Step`` with a count."""
        last = self.actions[-1] if self.actions else None
        if isinstance(action, Step) and isinstance(last, Step):
            self.actions[-1] = Step(last.times + 1)
        else:
            self.actions.append(action)

    def recorded(self) -> Run:
        """This driver's run as a repro records it."""
        return Run(self.config or OpenConfig(), tuple(self.actions))

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams,
               session_id: str | None = None) -> None:
        """``session_id``: the turn carries only its new tokens; the backend puts the
        session's context before them."""
        self._log(Submit(rid, tuple(prompt_ids), params, session_id))
        with self._calling(f"handle.submit({rid!r})"):
            self.handle.submit(Request(rid, tuple(prompt_ids), params, session_id))
        full = list(prompt_ids)
        inherited = 0
        if session_id is not None:
            full = self.contexts[session_id] + full
            self.turns[rid] = (session_id, full)
            inherited = self._session_prefix(session_id)
        self.retraction.submitted(rid, inherited)
        self.prompt_lens[rid] = len(full)
        self.streamed[rid] = []
        self.aborted.discard(rid)
        self.live.add(rid)

    def _calling(self, what: str) -> AbstractContextManager[None]:
        live = sorted(self.live)
        shown = ", ".join(live[:8]) + (f", ... ({len(live)} in all)" if len(live) > 8 else "")
        return backend_call(f"{what}; live requests: [{shown}]")

    def open_session(self, session_id: str) -> None:
        self._log(OpenSession(session_id))
        with self._calling(f"handle.open_session({session_id!r})"):
            self.handle.open_session(session_id)
        self.contexts[session_id] = []

    def close_session(self, session_id: str) -> None:
        self._log(CloseSession(session_id))
        with self._calling(f"handle.close_session({session_id!r})"):
            self.handle.close_session(session_id)
        del self.contexts[session_id]

    def abort(self, rid: str) -> None:
        self._log(Abort(rid))
        self.aborted.add(rid)
        with self._calling(f"handle.abort({rid!r})"):
            self.handle.abort(rid)

    def step(self) -> list[Event]:
        self._log(Step())
        with self._calling(f"handle.step() call {self.steps + 1}"):
            events = self.handle.step()
        self.steps += 1
        where = f"step {self.steps}"
        for ev in events:
            self._record(ev, where)
        if self.caps.memory_view:
            with self._calling(f"handle.memory() after step {self.steps}"):
                view = self.handle.memory()
            self.view = view
            asked = None if self.config is None else self.config.page_size
            problem = page_size_error(view, asked)
            if problem:
                raise InvariantError(f"{where}: {problem}")
            if self.live:
                check_busy(view, self.prompt_lens,
                           {r: len(t) for r, t in self.streamed.items()}, where, self.overlap)
            else:
                check_idle(view, f"{where} (idle)", sessions_closed=not self.contexts)
            problem = self.retraction.observe(self.steps, events, view, self.live - self.aborted)
            if problem:
                raise InvariantError(f"{where}: {problem}")
        return events

    def _record(self, ev: Event, where: str) -> None:
        if ev.rid not in self.prompt_lens:
            raise InvariantError(f"{where}: event for unknown request {ev.rid!r}: {ev}")
        if ev.rid not in self.live:
            raise InvariantError(f"{where}: event for finished request {ev.rid!r}: {ev}")
        if isinstance(ev, TokenEvent):
            self.streamed[ev.rid].extend(ev.token_ids)
        elif isinstance(ev, RetractEvent):
            self.retractions += 1
            self.retracted[ev.rid] += 1
        elif isinstance(ev, FinishEvent):
            if ev.reason == "abort" and ev.rid not in self.aborted:
                # e.g. a session turn given up under memory pressure instead of retracted: the
                # output looks like a clean rollback, but the request was never served
                raise InvariantError(f"{where}: request {ev.rid!r} finished 'abort' after "
                                     f"{len(self.streamed[ev.rid])} tokens, but the suite never "
                                     f"aborted it (a backend aborts only when asked)")
            if ev.reason != "abort" and list(ev.output_ids) != self.streamed[ev.rid]:
                raise InvariantError(f"{where}: request {ev.rid!r} finished with "
                                     f"{len(ev.output_ids)} tokens but streamed "
                                     f"{len(self.streamed[ev.rid])} different ones")
            self.live.discard(ev.rid)
            self.outcomes[ev.rid] = Outcome(ev.rid, list(ev.output_ids), ev.reason, ev.text,
                                            list(ev.accept_lens), ev.cached_tokens)
            if ev.rid in self.turns:
                self._end_turn(ev, where)

    def _end_turn(self, ev: FinishEvent, where: str) -> None:
        """A session turn finished: check the KV it inherited; a completed turn extends the
        context, an aborted one leaves it as it was (the session rolls back)."""
        session_id, full = self.turns[ev.rid]
        context = self.contexts[session_id]
        want = self._session_prefix(session_id)
        if ev.cached_tokens != want:
            raise InvariantError(
                f"{where}: turn {ev.rid!r} of session {session_id!r} reused {ev.cached_tokens} "
                f"cached tokens, expected {want} (the session's {len(context)}-token context "
                f"of earlier prompts and completions, minus its final token)")
        if ev.reason != "abort":
            self.contexts[session_id] = full + list(ev.output_ids)

    def _session_prefix(self, session_id: str) -> int:
        """Positions of the session's context a turn inherits KV for: all but the final
        token, whose KV no forward computed."""
        return max(len(self.contexts[session_id]) - 1, 0)

    def run(self, max_steps: int = 100_000) -> dict[str, Outcome]:
        """Step until every submitted request has finished."""
        self.step_until(lambda: not self.live, max_steps,
                        lambda: f"{len(self.live)} requests still live: {sorted(self.live)[:5]}")
        return self.outcomes

    def step_until(self, done: Callable[[], bool], max_steps: int,
                   what: Callable[[], str]) -> None:
        """Step until ``done()``; a backend that stalls fails the check instead of hanging it."""
        start = self.steps
        while not done():
            if self.steps - start >= max_steps:
                raise InvariantError(f"no progress after {max_steps} steps: {what()}")
            self.step()


def step_budget(requests: list[tuple[list[int], SamplingParams]]) -> int:
    """A generous bound on steps for a run: every token of every request, plus prefills."""
    return 64 + sum(len(p) + s.max_new_tokens for p, s in requests) * 2
