"""Phase-separated speculative inputs (bug class "phase confusion", docs/bug-classes.md): one
type per phase, never one object whose fields change meaning between phases.

Shapes (``b`` requests, ``k`` = topk, ``N`` = num_draft_tokens incl. the root, ``H`` hidden):

* ``DraftInput`` — the batch's persistent spec state between steps, one row per request:
  ``topk_p [b, k] float32``, ``topk_index [b, k] int64`` (candidates for the token after the
  root), ``hidden_states [b, H]`` (the draft's predicted feature at the root's position),
  ``verified_id [b] int64`` (the root: the newest emitted token, whose KV is not yet written).
  It follows the batch through ``filter_batch`` (finish, abort, retract) and ``merge_batch``
  (newly prefilled requests); every per-request tensor is filtered and merged together.
  Frozen-KV MTP keeps a ``SeedInput`` instead, a standalone draft model a ``CatchUpInput``,
  n-gram speculation an ``NgramInput``.
* ``VerifyInput`` — lives inside one step only, so it has no filter/merge (bug class
  all-finish-in-verify: a leftover VerifyInput on the batch crashed the next merge):
  ``draft_tokens [b, N]`` (node 0 = root),
  ``tree_mask [b, N, N]`` (node i sees itself and its ancestors), ``positions [b, N]`` (
  ``seq_len + depth``), ``parents [b, N]`` (-1 for the root), ``retrieve_index [b, N]``
  (flat row ``i * N + node``), ``retrieve_next_token [b, N]`` (first child, -1 none),
  ``retrieve_next_sibling [b, N]`` (next sibling, -1 none).
* ``DraftExtendInput`` — what verify hands to draft-extend, rows for unfinished requests only,
  ragged: ``hidden_states [T, H]`` (target features at accepted nodes), ``input_ids [T]`` (the
  token after each accepted node), ``accept_lens [b']`` (``T = sum(accept_lens)``).
"""

from __future__ import annotations

from dataclasses import Field, dataclass, fields, replace
from typing import ClassVar, Self

import torch

from refengine.device import from_host


def _rows(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(0, keep)


class _PerRequestRows:
    """A dataclass whose every field holds one row per request: filtered and merged together,
    so the state follows the batch through finish, abort, retraction and admission."""

    # Set by ``@dataclass`` on every subclass; declared so ``fields`` and ``replace`` take it.
    __dataclass_fields__: ClassVar[dict[str, Field[torch.Tensor]]]

    def columns(self) -> dict[str, torch.Tensor]:
        """Every field by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.columns().items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"{type(self).__name__}: fields disagree on the row count {sizes}")

    @property
    def batch_size(self) -> int:
        return int(next(iter(self.columns().values())).shape[0])

    @property
    def device(self) -> torch.device:
        return next(iter(self.columns().values())).device

    def filter_batch(self, keep: torch.Tensor) -> Self:
        """Rows ``keep`` (int64 indices, in the new batch order), every tensor together."""
        return replace(self, **{name: _rows(t, keep) for name, t in self.columns().items()})

    def merge_batch(self, other: Self) -> Self:
        """This batch's rows followed by ``other``'s."""
        theirs = other.columns()
        return replace(self, **{name: torch.cat([t, theirs[name]])
                                for name, t in self.columns().items()})


@dataclass
class DraftInput(_PerRequestRows):
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor
    verified_id: torch.Tensor

    @classmethod
    def idle(cls, topk: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str
             ) -> DraftInput:
        """Zero rows, correct dtypes, trailing shapes and device: a valid empty draft state."""
        return cls(topk_p=torch.empty((0, topk), dtype=torch.float32, device=device),
                   topk_index=torch.empty((0, topk), dtype=torch.int64, device=device),
                   hidden_states=torch.empty((0, hidden_size), dtype=dtype, device=device),
                   verified_id=torch.empty((0,), dtype=torch.int64, device=device))


@dataclass
class SeedInput(_PerRequestRows):
    """Frozen-KV MTP's persistent state between steps: per request the root token
    (``bonus_tokens [b] int64``) and the target's feature at the position that produced it
    (``hidden_states [b, H]``). The draft loop's first iteration (the seed) turns it into
    candidates; nothing else carries over, because the assistant keeps no KV."""

    bonus_tokens: torch.Tensor
    hidden_states: torch.Tensor

    @classmethod
    def idle(cls, hidden_size: int, dtype: torch.dtype, device: torch.device | str
             ) -> SeedInput:
        return cls(torch.empty((0,), dtype=torch.int64, device=device),
                   torch.empty((0, hidden_size), dtype=dtype, device=device))


@dataclass
class CatchUpInput(_PerRequestRows):
    """Draft-model speculation's state between steps: per request the root token
    (``verified_id [b] int64``) and ``behind [b] int64``, how many committed positions just
    before the root still lack the draft's KV (1 after a step that accepted the whole chain:
    the draft never ran its last token). The next step's first draft forward runs those
    positions together with the root; a standalone draft carries nothing else."""

    verified_id: torch.Tensor
    behind: torch.Tensor

    @classmethod
    def idle(cls, device: torch.device | str) -> CatchUpInput:
        return cls(torch.empty((0,), dtype=torch.int64, device=device),
                   torch.empty((0,), dtype=torch.int64, device=device))


@dataclass
class NgramInput(_PerRequestRows):
    """N-gram speculation's state between steps: per request the root (``verified_id [b]
    int64``) and its context, every token up to and including the root at its position
    (``tokens [b, W] int64``, W: the context limit plus the verify block; zero past the root).
    The drafter keeps the context itself: an overlap launch cannot read the request's output,
    which lags by the unresolved step, so it follows the accepted runs as they are launched."""

    verified_id: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def idle(cls, width: int, device: torch.device | str) -> NgramInput:
        return cls(torch.empty((0,), dtype=torch.int64, device=device),
                   torch.empty((0, width), dtype=torch.int64, device=device))


@dataclass
class VerifyInput:
    draft_tokens: torch.Tensor
    tree_mask: torch.Tensor
    positions: torch.Tensor
    parents: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    # Each root's position on the host, where the tree's builder had them (a forward's shapes
    # need them there); None: read from ``positions``.
    roots: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.draft_tokens.shape[0])

    def root_positions(self) -> list[int]:
        """Each root's position (``positions[:, 0]``), from the host copy where there is one."""
        return self.roots if self.roots is not None else self.positions[:, 0].tolist()

    @classmethod
    def idle(cls, num_draft_tokens: int, device: torch.device | str) -> VerifyInput:
        n = num_draft_tokens
        empty = torch.empty((0, n), dtype=torch.int64, device=device)
        return cls(empty, torch.empty((0, n, n), dtype=torch.bool, device=device), empty.clone(),
                   empty.clone(), empty.clone(), empty.clone(), empty.clone())


@dataclass
class DraftExtendInput:
    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    accept_lens: torch.Tensor
    # ``accept_lens`` on the host, where the builder had them (the extend batch's shapes need
    # them there); None: read from the tensor.
    lens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.lens is not None and len(self.lens) != self.accept_lens.shape[0]:
            raise ValueError(f"DraftExtendInput: {len(self.lens)} host lengths for "
                             f"{self.accept_lens.shape[0]} accept_lens")
        total = sum(self.host_lens())
        if self.hidden_states.shape[0] != total or self.input_ids.shape[0] != total:
            raise ValueError(f"DraftExtendInput: {self.hidden_states.shape[0]} hidden rows and "
                             f"{self.input_ids.shape[0]} ids for accept_lens summing to {total}")

    def host_lens(self) -> list[int]:
        """``accept_lens`` as a list, from the host copy where there is one."""
        return self.lens if self.lens is not None else self.accept_lens.tolist()

    @property
    def batch_size(self) -> int:
        return int(self.accept_lens.shape[0])

    @classmethod
    def idle(cls, hidden_size: int, dtype: torch.dtype, device: torch.device | str
             ) -> DraftExtendInput:
        return cls(torch.empty((0, hidden_size), dtype=dtype, device=device),
                   torch.empty((0,), dtype=torch.int64, device=device),
                   torch.empty((0,), dtype=torch.int64, device=device))

    def _offsets(self) -> torch.Tensor:
        return torch.cumsum(self.accept_lens, 0) - self.accept_lens

    def filter_batch(self, keep: torch.Tensor) -> DraftExtendInput:
        starts, lens = self._offsets()[keep], self.accept_lens[keep]
        host_lens = lens.tolist()
        token_rows = from_host([i for s, n in zip(starts.tolist(), host_lens, strict=True)
                                for i in range(s, s + n)], keep.device)
        return DraftExtendInput(_rows(self.hidden_states, token_rows),
                                _rows(self.input_ids, token_rows), lens, host_lens)

    def merge_batch(self, other: DraftExtendInput) -> DraftExtendInput:
        return DraftExtendInput(torch.cat([self.hidden_states, other.hidden_states]),
                                torch.cat([self.input_ids, other.input_ids]),
                                torch.cat([self.accept_lens, other.accept_lens]),
                                self.host_lens() + other.host_lens())
