"""Driver: runs requests through an EngineHandle and checks every step from outside.

After each ``step()`` it checks the event stream (tokens only for live requests, one finish per
request, finish output == the tokens streamed) and, when the backend claims ``memory_view``,
the memory invariants M1-M3; whenever nothing is live, M4/M5. A run that stops making progress
fails instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from conformance.adapter import (
    Capabilities,
    EngineHandle,
    Event,
    FinishEvent,
    Request,
    RetractEvent,
    SamplingParams,
    TokenEvent,
)
from conformance.invariants import InvariantError, check_busy, check_idle


@dataclass
class Outcome:
    rid: str
    output_ids: list[int]
    reason: str
    text: str
    accept_lens: list[int]


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

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.handle.submit(Request(rid, tuple(prompt_ids), params))
        self.prompt_lens[rid] = len(prompt_ids)
        self.streamed[rid] = []
        self.live.add(rid)

    def abort(self, rid: str) -> None:
        self.handle.abort(rid)

    def step(self) -> list[Event]:
        events = self.handle.step()
        self.steps += 1
        where = f"step {self.steps}"
        for ev in events:
            self._record(ev, where)
        if self.caps.memory_view:
            view = self.handle.memory()
            if self.live:
                check_busy(view, self.prompt_lens,
                           {r: len(t) for r, t in self.streamed.items()}, where, self.overlap)
            else:
                check_idle(view, f"{where} (idle)")
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
        elif isinstance(ev, FinishEvent):
            if ev.reason != "abort" and list(ev.output_ids) != self.streamed[ev.rid]:
                raise InvariantError(f"{where}: request {ev.rid!r} finished with "
                                     f"{len(ev.output_ids)} tokens but streamed "
                                     f"{len(self.streamed[ev.rid])} different ones")
            self.live.discard(ev.rid)
            self.outcomes[ev.rid] = Outcome(ev.rid, list(ev.output_ids), ev.reason, ev.text,
                                            list(ev.accept_lens))

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
