"""The graph probe protocol: how the graph tier sees a backend's graph runner (capability
``graph_runner``; docs/adapter.md).

A graph runner replays a forward on static buffers padded up to a bucket. What can go wrong
is invisible in a normal run's tokens: padded rows that read or write a real request's KV, a
tail left over from an earlier batch, buffers that move, outputs that alias memory the next
replay overwrites. So the tier asks the backend to run synthetic *cases* -- a kind, a raw
batch size, a seed -- both eagerly (no padding) and through its graph runner, and to report
what it needs to compare them from outside (``GraphRun``). Nothing in the protocol is
specific to one engine: a kind is a name the backend chooses ("decode", "verify-tree", a draft
loop), inputs derive from the seed on the backend side, state is compared by digest.

A graph runner also picks a *key width* per replay (how many key columns each request's
attention gathers): a probe that lists its widths (the optional ``KeyWidthProbe``) takes cases
with a ``context`` length and reports the width each graph run used, so the tier can run cases
either side of every width and check the choice.

The data types ``GraphCase``, ``GraphRun`` and ``PaddingPolicy`` are defined here, with the
protocol; the reference engine's probe (``backends/refengine/graph_probe.py``) uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the contract never imports torch at run time
    import torch

__all__ = ["PADDED_FIELDS", "STATE_DIGESTS", "GraphCase", "GraphProbe", "GraphRun",
           "KeyWidthProbe", "Mode", "PaddingPolicy"]

Mode = Literal["eager", "graph"]

# The index fields a probe reports for the padded rows (``GraphRun.padded``), and what the
# padding policy requires of each: the reserved row, the reserved slot, a token id in the
# vocabulary, a position in the rotary table, the fill length. A kind reports the ones it
# stages (a draft loop that writes no KV has no slots).
PADDED_FIELDS = ("request_rows", "out_slots", "token_ids", "positions", "lengths")

# The state digests every run reports (``GraphRun.initial`` / ``GraphRun.state``): the KV pool
# outside the real rows' target slots and the reserved dummy page (the whole pool but the dummy
# page for a kind that writes no KV), the request-row table, the allocators.
STATE_DIGESTS = ("kv", "request_rows", "allocator")


@dataclass(frozen=True)
class GraphCase:
    """One synthetic forward: ``kind``, ``raw`` real requests, inputs derived from ``seed``
    (the same seed with a bigger ``raw`` extends the smaller batch by more requests).

    ``context`` (only for a ``KeyWidthProbe``): the key length of the case's longest request,
    the positions its attention spans in this forward (its cached prefix and what the forward
    adds: the new token, the verify block, the draft's scratch); None: the probe's own short
    lengths."""

    kind: str
    raw: int
    seed: int = 0
    context: int | None = None


@dataclass(frozen=True)
class PaddingPolicy:
    """What a padded row of a kind must hold in its index fields: the reserved row and slot
    (never a real request's), a token id inside the vocabulary, a position inside the rotary
    table and a fixed length (so its attention spans nothing a request owns)."""

    dummy_row: int
    dummy_slot: int
    vocab_size: int
    length_fill: int
    max_position: int


@dataclass
class GraphRun:
    """What one run of a case reports.

    ``outputs``: the real rows only (integer tensors compared exactly, floats within the
    probe's ``float_tolerance``; ``next_tokens``, the argmax of ``logits`` where a run reports
    both, up to near-tie flips that logits within the tolerance may make).
    ``initial``/``state``: digests of engine state the real rows
    do not own, right before and right after the forward -- the KV pool outside the real rows'
    target slots and outside the reserved dummy page ("kv"; for a kind that writes no KV, the
    whole pool but the dummy page), the request-row table ("request_rows") and the allocators
    ("allocator"). ``buffers``: data pointer of every static buffer the graph run used (empty
    for eager). ``padded``: the staged index fields of the padded rows (``PADDED_FIELDS``'
    names; empty tensors when the batch filled its bucket, none for eager). ``key_width``:
    the key width the graph run replayed on (None: eager, or a probe that does not say)."""

    case: GraphCase
    mode: Mode
    bucket: int
    outputs: dict[str, torch.Tensor]
    initial: dict[str, str]
    state: dict[str, str]
    buffers: dict[str, int] = field(default_factory=dict)
    padded: dict[str, torch.Tensor] = field(default_factory=dict)
    key_width: int | None = None


@runtime_checkable
class GraphProbe(Protocol):
    """What ``EngineHandle.graph_probe()`` returns (backends claiming ``graph_runner``).

    The handle is fresh and idle when the tier asks for it; the probe may use the handle's
    engine (it should: the point is to test the real graph runner), as long as every run starts
    from the same state, so an eager and a graph run of one case are comparable, while the
    graph runner itself (static buffers, captured graphs) lives on across runs.
    """

    def kinds(self) -> tuple[str, ...]:
        """The kinds of graph forward the backend replays, e.g. ("decode", "verify-tree")."""

    def max_batch(self) -> int:
        """The largest raw batch size the graph runner replays (the tier runs 1..this)."""

    def buckets(self) -> tuple[int, ...]:
        """The captured batch sizes, ascending; a raw size runs on the smallest one >= it."""

    def padding_policy(self, kind: str) -> PaddingPolicy:
        """What a padded row of ``kind`` holds in its index fields."""

    def float_tolerance(self) -> float:
        """Absolute tolerance for floating-point outputs, graph against eager."""

    def writes_kv(self, kind: str) -> bool:
        """Whether ``kind``'s real rows write KV (a frozen-KV draft's do not)."""

    def run(self, case: GraphCase, mode: Mode, poison: bool = False
            ) -> GraphRun:
        """Run ``case``: "eager" is the unpadded eager computation, "graph" stages, pads,
        executes on the graph runner and slices. ``poison``: before staging, fill the padded
        tail of every static buffer with hostile values (NaN floats, out-of-range integers)."""


@runtime_checkable
class KeyWidthProbe(Protocol):
    """Optional, on top of ``GraphProbe``: a graph runner whose keys also fix a key width. Its
    probe takes ``GraphCase.context`` and reports ``GraphRun.key_width``; the tier then runs
    every kind either side of every width (a probe without these methods gets those checks
    reported not applicable)."""

    def key_widths(self, kind: str) -> tuple[int, ...]:
        """``kind``'s key widths, ascending; a replay uses the smallest that holds its
        longest request's key length (``GraphCase.context``)."""

    def max_context(self, kind: str) -> int:
        """The longest ``context`` a case of ``kind`` can have (the widest width, the model's
        positions, the room the kind needs past it)."""
