"""SpecWorker: what the engine needs from a speculative algorithm, and nothing more.

The engine schedules, launches and resolves; a worker owns everything specific to speculative
decoding: its draft state between steps (which follows the batch through finish, abort and
retraction), the KV a decode step holds past each request's committed end (the scheduler
reserves it), what it does after a target prefill, and the decode step itself. It runs
forwards only through the ``Runner``, writes KV tensors only into slots it was given and
never writes request or KV bookkeeping: ``Scheduler`` allocates, ``OutputProcessor.resolve``
commits (``tests/test_kv_writer_rule.py``). The reference implementation is
``speculative/core.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from refengine.memory.reservation import DecodeReservation
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.step import StepResult


class SpecWorker(Protocol):
    @property
    def reservation(self) -> DecodeReservation:
        """The KV a decode step holds past each request's committed end (the scheduler
        reserves it before launch)."""

    @property
    def reserve_bound(self) -> int:
        """How far past its committed end a request may hold KV between steps."""

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        """After a target prefill (before its KV is committed): ``sampled`` maps the requests
        whose fill completed to the token just sampled for them."""

    def launch(self, reqs: list[Req]) -> StepResult:
        """One speculative decode step's forwards; nothing about the requests changes."""

    def resolved(self, result: StepResult, kept: list[int]) -> None:
        """After resolve: ``kept`` indexes the requests of ``result`` still running."""

    def drop(self, rid: str) -> None:
        """A request finished, was aborted or retracted: forget its draft state."""
