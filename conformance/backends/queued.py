"""The handle of a backend that runs every queued request to completion in one ``step`` call
(hf, ctranslate2): the queue, the submit checks, the finish events, and the adapter calls such
a backend cannot serve (abort, the memory view, sessions), refused with its reason."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from conformance.backends.request_check import check_request
from conformance.contract import Event, FinishEvent, FinishReason, MemoryView, Request, TokenEvent
from conformance.contract.finish import FinishRule

# Requests per decoding call when the suite sets no ``max_running_requests``.
DEFAULT_MAX_BATCH = 64


@dataclass(eq=False)
class QueuedJob:
    """One queued request and its progress inside a ``step``."""

    req: Request
    rule: FinishRule
    seed: int = 0                            # its sampling seed, for backends that draw per row
    output_ids: list[int] = field(default_factory=list)
    reason: FinishReason | None = None
    accept_lens: list[int] = field(default_factory=list)  # per verify (assisted generation)

    def append(self, token: int) -> bool:
        """Add ``token`` and apply the finish rule; True once the request has finished."""
        self.output_ids.append(token)
        self.reason = self.rule.reason(self.output_ids)
        return self.reason is not None


class QueuedHandle:
    """``submit`` queues (after the adapter's request checks), ``step`` runs the whole queue
    through ``run`` and reports each request's tokens and finish, in submission order.

    ``unsupported`` gives the reason for each of "abort", "memory_view" and "sessions"."""

    def __init__(self, name: str, vocab_size: int, max_context_len: int, eos_token_id: int,
                 max_batch: int | None, decode: Callable[[list[int]], str],
                 unsupported: Mapping[str, str]) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.eos_token_id = eos_token_id
        self.max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        self.decode = decode
        self.unsupported = unsupported
        self.closed = False
        self._queue: list[QueuedJob] = []

    def make_job(self, req: Request, rule: FinishRule) -> QueuedJob:
        """The job for a checked request (a backend adds its own checks or seed here)."""
        return QueuedJob(req, rule)

    def run(self, jobs: list[QueuedJob]) -> None:
        """Decode every job until its rule finishes it."""
        raise NotImplementedError

    def batches(self, jobs: list[QueuedJob]) -> Iterator[list[QueuedJob]]:
        """``jobs`` in order, ``max_batch`` at a time."""
        for start in range(0, len(jobs), self.max_batch):
            yield jobs[start:start + self.max_batch]

    # --- adapter surface ----------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self.check_open()
        check_request(req, (job.req.rid for job in self._queue), self.vocab_size,
                      self.max_context_len, self.name)
        rule = FinishRule(req.params, len(req.prompt_ids), self.eos_token_id,
                          self.max_context_len, self.decode)
        self._queue.append(self.make_job(req, rule))

    def step(self) -> list[Event]:
        self.check_open()
        jobs, self._queue = self._queue, []
        self.run(jobs)
        events: list[Event] = []
        for job in jobs:
            assert job.reason is not None
            out = tuple(job.output_ids)
            events.append(TokenEvent(job.req.rid, out))
            events.append(FinishEvent(job.req.rid, job.reason, out,
                                      job.rule.text(job.output_ids, job.reason),
                                      tuple(job.accept_lens)))
        return events

    def abort(self, rid: str) -> None:
        raise NotImplementedError(f"{self.name} backend: {self.unsupported['abort']}")

    def memory(self) -> MemoryView:
        raise NotImplementedError(f"{self.name} backend: {self.unsupported['memory_view']}")

    def open_session(self, session_id: str) -> None:
        raise NotImplementedError(f"{self.name} backend: {self.unsupported['sessions']}")

    def close_session(self, session_id: str) -> None:
        raise NotImplementedError(f"{self.name} backend: {self.unsupported['sessions']}")

    def close(self) -> None:
        self.closed = True
        self._queue = []

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.name} backend: handle is closed")
