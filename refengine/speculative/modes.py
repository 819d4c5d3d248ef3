"""How the verify core runs a decode step: sequentially, or under overlap scheduling (V2).

* ``Sequential`` (V1): a step is launched and resolved in one engine step. Its reservation
  (the verify block or the draft scratch, whichever is longer) is freed at resolve past the
  accepted run, so between steps a request holds nothing past its committed end; each root sits
  at the committed end, and draft-extend runs after resolve.
* ``Overlap`` (V2, ``SpecConfig(overlap=True)``): a step is launched one engine step before it
  is resolved, so it cannot read the engine's request state (which lags by the unresolved
  step). The reservation is ``committed + 1 + 2L`` positions, page-aligned, kept between steps
  and topped up by the scheduler, and the root's slot is pre-claimed (``L = max(topk *
  num_steps, N)``; 2L: the committed length lags the truth by up to L positions and the step
  being launched needs up to L more). The launched step carries its own truth forward: it
  moves a tree's accepted KV into place, runs draft-extend and records each request's next
  root position (``seq``), which the next step is launched from. Resolution commits the
  accepted run minus the pre-claimed root; a stale result changes nothing
  (``OutputProcessor``). Between steps a request may hold up to ``2L + page_size - 1``
  positions past its committed end (``reserve_bound``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from refengine.config import SpecConfig
from refengine.memory.manager import KVManager
from refengine.memory.reservation import DecodeReservation
from refengine.request import Req


def overlap_window(spec: SpecConfig) -> int:
    """2L, the overlap window: positions an overlap reservation holds past each root (see the
    module docstring)."""
    return 2 * max(spec.topk * spec.num_steps, spec.num_draft_tokens)


def row_headroom(spec: SpecConfig, page_size: int) -> int:
    """``row_headroom``: row-table width past the context end a decode step may index (the
    positions of its reservation there)."""
    if spec.overlap:
        return 1 + overlap_window(spec) + page_size
    return max(spec.topk * spec.num_steps, spec.num_draft_tokens)


class Sequential:
    overlap = False
    reserve_bound = 0  # resolve frees everything past the accepted run

    def reservation(self, block: int, scratch: int) -> DecodeReservation:
        return DecodeReservation(block, scratch)

    def roots(self, reqs: list[Req]) -> list[int]:
        """Each root sits at its request's committed end (resolve ran before this step)."""
        return [r.kv_committed_len for r in reqs]

    def output_index(self, req: Req) -> int:
        """The output index of the first token this step emits for ``req``."""
        return len(req.output_ids)

    def started(self, reqs: list[Req]) -> None:
        """``reqs`` completed their prefill: their roots are their committed ends."""

    def launchable(self, reqs: list[Req]) -> list[Req]:
        return reqs

    def drop(self, rid: str) -> None:
        """Nothing per request besides the draft state."""

    @contextmanager
    def rooted_at_committed_end(self, reqs: list[Req]) -> Iterator[None]:
        yield  # roots are the committed ends already


class Overlap:
    overlap = True

    def __init__(self, spec: SpecConfig, kv: KVManager, max_context_len: int) -> None:
        self.kv = kv
        self.max_context_len = max_context_len
        self.window = overlap_window(spec)
        self.seq: dict[str, int] = {}  # rid -> root position after the last launched step

    @property
    def reserve_bound(self) -> int:
        return self.window + self.kv.page_size - 1

    def reservation(self, block: int, scratch: int) -> DecodeReservation:
        return DecodeReservation(1 + self.window, page_aligned=True, preclaim_root=True)

    def roots(self, reqs: list[Req]) -> list[int]:
        return [self.seq[r.rid] for r in reqs]

    def output_index(self, req: Req) -> int:
        # The request's output lags the launched steps; the root (its newest token, at
        # position seq) is output index seq - prompt, so this step's first token is one more.
        return self.seq[req.rid] - len(req.prompt_ids) + 1

    def started(self, reqs: list[Req]) -> None:
        for req in reqs:  # the sampled token is the root, at the fill's end
            self.seq[req.rid] = len(req.fill_ids)

    def launchable(self, reqs: list[Req]) -> list[Req]:
        """``reqs`` without those the unresolved step already took to their length limit:
        they finish when it is resolved, so this step's work for them would be stale."""
        return [r for r in reqs if not (
            self.output_index(r) >= r.params.max_new_tokens  # outputs so far, root included
            or self.seq[r.rid] + 1 >= self.max_context_len)]

    def advance(self, reqs: list[Req], accepted: list[list[int]]) -> None:
        """Inside the launched step: move each accepted path's KV to the positions after its
        root (a tensor write into slots the request holds) and root the next step there."""
        with self.kv.batched_moves():
            for req, nodes in zip(reqs, accepted, strict=True):
                root = self.seq[req.rid]
                self.kv.move_path(req, root, nodes)
                self.seq[req.rid] = root + len(nodes)

    def drop(self, rid: str) -> None:
        self.seq.pop(rid, None)

    @contextmanager
    def rooted_at_committed_end(self, reqs: list[Req]) -> Iterator[None]:
        """Root ``reqs`` at their committed end (enter before the caller reserves them), then
        forget the roots."""
        self.seq.update({req.rid: req.kv_committed_len for req in reqs})
        try:
            yield
        finally:
            for req in reqs:
                self.seq.pop(req.rid, None)


StepMode = Sequential | Overlap
