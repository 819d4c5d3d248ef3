"""EAGLE V2: V1's draft -> verify -> draft-extend, launched one step ahead of its resolution
(overlap scheduling, ``SpecConfig(overlap=True)``).

What changes against V1:

* **Allocation only at schedule time.** ``prepare_for_decode`` tops each request's reservation
  up to ``committed + 1 + 2L`` positions, page-aligned (``L = max(topk * num_steps, N)``), and
  pre-claims the root's slot (``committed += 1``: every verify commits the root). The launched
  step never allocates or frees: draft scratch and the verify block use reserved positions from
  the root on. Why 2L: the engine's committed length lags the truth by the unresolved step
  (up to L positions), and the step being launched needs up to L more.
* **The step carries its own truth forward.** ``launch`` runs draft, verify and draft-extend,
  moves a tree's accepted KV into place (through the KV manager) and records each request's
  new root position in ``seq``: the next step is launched from it before this one is resolved.
  This map is the "future" the next batch reads; the engine's request state is not.
* **Resolution one step late** (``OutputProcessor``): ``committed += accepted - 1`` (the root
  was pre-claimed), and a stale result (its request finished, was aborted or retracted since
  launch) changes nothing. A retracted request's KV was released with it. A request finishing
  while a step that pre-claimed its root is in flight gives that claim back at its finish, so
  its committed length is exactly ``prompt + output - 1`` (what a streaming session keeps).

Between steps a request may hold up to ``2L + page_size - 1`` positions past its committed end
(``reserve_bound``), and a decoding request in flight has pre-claimed its root, so its committed
length is ``prompt + output`` rather than V1's ``prompt + output - 1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from refengine.clock import PhaseClock
from refengine.config import SpecConfig
from refengine.memory.manager import KVManager
from refengine.memory.reservation import DecodeReservation
from refengine.model.llama import ForwardBatch
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.eagle_v1 import EagleV1Worker
from refengine.step import StepResult


def reserve_tokens(spec: SpecConfig) -> int:
    """2L: positions reserved past the committed end at every decode step."""
    return 2 * max(spec.topk * spec.num_steps, spec.num_draft_tokens)


class EagleV2Worker(EagleV1Worker):
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager,
                 clock: PhaseClock) -> None:
        super().__init__(spec, runner, kv, clock)
        self.reserve_tokens = reserve_tokens(spec)
        self.seq: dict[str, int] = {}  # rid -> root position after the last launched step

    @property
    def reservation(self) -> DecodeReservation:
        return DecodeReservation(1 + self.reserve_tokens, page_aligned=True,
                                 preclaim_root=True)

    @property
    def reserve_bound(self) -> int:
        return self.reserve_tokens + self.kv.page_size - 1

    def drop(self, rid: str) -> None:
        super().drop(rid)
        self.seq.pop(rid, None)

    def prefill(self, reqs: list[Req], lens: list[int], batch: ForwardBatch,
                features: torch.Tensor, sampled: dict[str, int]) -> None:
        super().prefill(reqs, lens, batch, features, sampled)
        for req in reqs:
            if req.rid in sampled:  # the sampled token is the root, at the fill's end
                self.seq[req.rid] = len(req.fill_ids)

    def roots(self, reqs: list[Req]) -> list[int]:
        return [self.seq[r.rid] for r in reqs]

    def output_index(self, req: Req) -> int:
        # The request's output lags the launched steps; the root (its newest token, at
        # position seq) is output index seq - prompt, so this step's first token is one more.
        return self.seq[req.rid] - len(req.prompt_ids) + 1

    @contextmanager
    def drafting_from_committed_end(self, reqs: list[Req]) -> Iterator[None]:
        """V2 drafts from the root of the last launched step: root ``reqs`` at their committed
        end (enter this before the caller reserves them, ``KVManager.reserved``), then forget
        the roots."""
        self.seq.update({req.rid: req.kv_committed_len for req in reqs})
        try:
            yield
        finally:
            for req in reqs:
                self.seq.pop(req.rid, None)

    def _done_before_launch(self, req: Req) -> bool:
        """The unresolved step already took ``req`` to its length limit: it finishes when that
        step is resolved, so this step's work for it would be thrown away as stale."""
        emitted = self.output_index(req)  # outputs so far, the root included
        return (emitted >= req.params.max_new_tokens
                or self.seq[req.rid] + 1 >= self.runner.target.config.max_position_embeddings)

    def launch(self, reqs: list[Req]) -> StepResult:
        reqs = [r for r in reqs if not self._done_before_launch(r)]
        if not reqs:
            return StepResult([], [], [], overlap=True, generations=[])
        generations = [r.retractions for r in reqs]
        with self.clock.timed("draft"):
            verify_input = self.draft(reqs, self.draft_state.aligned([r.rid for r in reqs]))
        with self.clock.timed("verify"):
            outcome = self.verify(reqs, verify_input)
        with self.clock.timed("extend"):
            for req, accepted in zip(reqs, outcome.nodes, strict=True):
                root = self.seq[req.rid]
                self.kv.move_path(req, root, accepted)
                self.seq[req.rid] = root + len(accepted)
            self.install_next(reqs, self.extend_input(outcome, list(range(len(reqs)))))
        return StepResult(reqs, outcome.emitted, [], outcome, overlap=True,
                          generations=generations)

    def resolved(self, result: StepResult, kept: list[int]) -> None:
        """Draft-extend ran inside the launched step; nothing is left to do."""
