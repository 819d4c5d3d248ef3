"""A backend for the project's tests: the reference engine with chosen output tokens rewritten,
for outputs that are broken (or legitimately different) on demand while every other behaviour
(events, memory view, sessions) stays the reference's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import Capabilities, Event, FinishEvent, OpenConfig, Request, TokenEvent

# (request, output index, the engine's token there) -> the token the backend reports
Rewrite = Callable[[Request, int, int], int]


class RewritingHandle:
    def __init__(self, inner: RefEngineHandle, rewrite: Rewrite) -> None:
        self.inner = inner
        self.rewrite = rewrite
        self.requests: dict[str, Request] = {}
        self.streamed: dict[str, int] = {}

    def submit(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.streamed[req.rid] = 0
        self.inner.submit(req)

    def _rewritten(self, rid: str, start: int, tokens: tuple[int, ...]) -> tuple[int, ...]:
        req = self.requests[rid]
        return tuple(self.rewrite(req, start + i, t) for i, t in enumerate(tokens))

    def step(self) -> list[Event]:
        events: list[Event] = []
        for event in self.inner.step():
            if isinstance(event, TokenEvent):
                start = self.streamed[event.rid]
                self.streamed[event.rid] += len(event.token_ids)
                event = replace(event, token_ids=self._rewritten(event.rid, start,
                                                                 event.token_ids))
            elif isinstance(event, FinishEvent):
                event = replace(event, output_ids=self._rewritten(event.rid, 0,
                                                                  event.output_ids))
            events.append(event)
        return events

    def __getattr__(self, name: str) -> object:  # abort, memory, sessions, close, hooks
        return getattr(self.inner, name)


class RewritingBackend(RefEngineBackend):
    """The reference engine declaring ``precision`` and reporting ``rewrite``'s tokens."""

    def __init__(self, name: str, rewrite: Rewrite, precision: str = "float32") -> None:
        self.name = name
        self.rewrite = rewrite
        self.precision = precision

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), precision=self.precision)

    def open(self, cfg: OpenConfig) -> RewritingHandle:
        return RewritingHandle(super().open(cfg), self.rewrite)
