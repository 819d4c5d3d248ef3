"""Staging for graph replays: batch-size buckets, static max-size input buffers, and the
padding that makes a replay on a bucket bigger than the real batch harmless.

A replayed forward always runs on the same tensors (same addresses, same shapes per bucket), so
a step's inputs are copied into prefix slices of buffers allocated once at the largest batch
size, and the rows between the real batch and the bucket are overwritten with values chosen so
that those rows read and write nothing a real request owns. The attention inputs (key slots
and the visibility mask) are not staged: they are derived inside the forward from the staged
request rows and lengths (``static_attention``), so they can never go stale on their own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refengine.model.attention import AttentionMetadata

# Reserved by the memory layer: row 0 of the request-row table is never handed to a request
# and never written (its entries stay 0), and KV page 0 (slots 0 .. page_size-1) is never
# allocated. Together: a padded row that looks its keys up through row 0 only finds slot 0.
DUMMY_ROW = 0
DUMMY_SLOT = 0


def capture_sizes(max_bs: int) -> list[int]:
    """Buckets for batches of 1 .. ``max_bs`` requests: 1, 2, 4, 8, then every 8, and
    ``max_bs`` itself. Small batches get tight buckets (padding there costs the most, relative
    to the real work); past 8 a step of 8 keeps the waste below 8 rows and the number of
    buckets (compiles, captures) linear but small."""
    if max_bs < 1:
        raise ValueError(f"max_bs: must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return check_sizes(sizes)


def check_sizes(sizes: list[int]) -> list[int]:
    """Buckets must be sorted, unique and positive (the largest is the buffers' size)."""
    if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"capture sizes: need sorted, unique, positive sizes, got {sizes}")
    return sizes


def kv_widths(table_width: int, smallest: int = 256) -> list[int]:
    """Key widths for a row table ``table_width`` columns wide: ``smallest``, doubling while
    the table is at least twice as wide, then the table width itself (which holds every
    request, so no batch is refused for its length). A step's attention gathers and masks the
    whole width of its key, not the real lengths, so one full-width key would make short
    contexts pay for the longest possible one. With the ladder a step pays for under four times
    its longest request (or ``smallest``): twice at most below the table width's own step."""
    widths, width = [], smallest
    while width * 2 <= table_width:
        widths.append(width)
        width *= 2
    return check_sizes([*widths, table_width])


def pad_to_bucket(raw: int, sizes: list[int]) -> int:
    """The smallest captured size >= ``raw``."""
    if not 1 <= raw <= sizes[-1]:
        raise ValueError(f"batch of {raw} requests: outside the captured sizes 1..{sizes[-1]}")
    return sizes[bisect.bisect_left(sizes, raw)]


@dataclass
class StepInputs:
    """One decode or verify forward, per request (``q`` new tokens each, request order).

    ``input_ids``/``positions``/``out_slots``: ``[b * q]`` flat, as in ``ForwardBatch``;
    ``rows [b]``: each request's row in the request-row table; ``seq_lens [b]``: its positions
    once this forward's KV is written (the new tokens are the last ``q``); ``tree_mask
    [b, q, q]``: which new tokens each new token sees (None: causal).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    tree_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])


@dataclass
class StagedViews:
    """The bucket-sized views of the static buffers one replay reads (same fields as
    ``StepInputs``; ``tree_mask`` always present)."""

    input_ids: torch.Tensor   # [bucket * q]
    positions: torch.Tensor   # [bucket * q]
    out_slots: torch.Tensor   # [bucket * q]
    rows: torch.Tensor        # [bucket]
    seq_lens: torch.Tensor    # [bucket]
    tree_mask: torch.Tensor   # [bucket, q, q]
    raw: int
    bucket: int
    q: int


def _first_key_only(q: int) -> torch.Tensor:
    mask = torch.zeros((q, q), dtype=torch.bool, device="cpu")  # a host constant, placed once
    mask[:, 0] = True
    return mask


@dataclass(frozen=True)
class Pad:
    """What a padded request's slice of one buffer holds, given ``q`` tokens per request."""

    fill: Callable[[int], int | torch.Tensor]
    why: str


# The padding policy, one entry per staged buffer. Every padded row must (a) keep every index
# in bounds, (b) write KV only into the reserved dummy page, (c) read KV only from it, and (d)
# compute finite values: real rows' masked-off key columns may point at slot 0 too (unused row
# entries are 0), and a masked key still multiplies its value by 0, so NaN there would leak.
PAD_POLICY: dict[str, Pad] = {
    "input_ids": Pad(lambda q: 0, "token 0 is in every vocabulary: the embedding gather stays "
                     "in bounds and yields finite values; the row's logits are dropped"),
    "positions": Pad(lambda q: 0, "row 0 of the rotary tables always exists; a position says "
                     "nothing about which KV is read (the row and length fields do)"),
    "out_slots": Pad(lambda q: DUMMY_SLOT, "the padded rows' K/V land in the reserved page, "
                     "which no request owns; duplicate writes there are harmless garbage"),
    "rows": Pad(lambda q: DUMMY_ROW, "the reserved row is never written, so every key slot "
                "gathered through it is the dummy slot; a stale real row here would read (and "
                "mask-expose) another request's KV"),
    "seq_lens": Pad(lambda q: q, "the new tokens then sit at positions 0..q-1 with no cached "
                    "prefix: a valid, minimal length that keeps every key column in bounds"),
    "tree_mask": Pad(_first_key_only, "every padded query sees exactly one key (column 0, the "
                     "dummy slot): never an all-masked softmax row, which some attention "
                     "kernels turn into NaN (that NaN would then be written to the dummy page)"),
}


class Staging:
    """Max-size static buffers for one forward kind (``q`` new tokens per request: 1 for
    decode, N for verify), allocated once; ``stage`` copies a step into them.

    Every buffer keeps one leading row per request, so a bucket's view is a contiguous prefix
    and the flat token views need no copy.
    """

    def __init__(self, max_bs: int, q: int, device: str | torch.device = "cpu") -> None:
        self.max_bs, self.q = max_bs, q
        tokens = (max_bs, q)
        self.buffers: dict[str, torch.Tensor] = {
            "input_ids": torch.zeros(tokens, dtype=torch.int64, device=device),
            "positions": torch.zeros(tokens, dtype=torch.int64, device=device),
            "out_slots": torch.full(tokens, DUMMY_SLOT, dtype=torch.int64, device=device),
            "rows": torch.full((max_bs,), DUMMY_ROW, dtype=torch.int64, device=device),
            "seq_lens": torch.full((max_bs,), q, dtype=torch.int64, device=device),
            "tree_mask": torch.zeros((max_bs, q, q), dtype=torch.bool, device=device),
        }
        assert set(self.buffers) == set(PAD_POLICY)
        self._fills = {name: pad.fill(q) for name, pad in PAD_POLICY.items()}
        self._fills["tree_mask"] = torch.as_tensor(self._fills["tree_mask"], device=device)
        self._causal = torch.ones((q, q), dtype=torch.bool, device=device).tril()

    def stage(self, step: StepInputs | None, bucket: int) -> StagedViews:
        """Copy ``step`` into rows ``[:raw]`` and pad rows ``[raw:bucket]`` by ``PAD_POLICY``.

        Only the bucket's rows are touched: rows past the bucket are never read by its replay.
        ``step=None`` stages a batch of padding only (capture and warm-up: it writes nothing
        but the dummy page)."""
        raw = 0 if step is None else step.batch_size
        if not 0 <= raw <= bucket <= self.max_bs:
            raise ValueError(f"staging {raw} requests into bucket {bucket} "
                             f"(buffers hold {self.max_bs})")
        b = self.buffers
        if step is not None:
            q = self.q
            b["input_ids"][:raw].copy_(step.input_ids.view(raw, q))
            b["positions"][:raw].copy_(step.positions.view(raw, q))
            b["out_slots"][:raw].copy_(step.out_slots.view(raw, q))
            b["rows"][:raw].copy_(step.rows)
            b["seq_lens"][:raw].copy_(step.seq_lens)
            b["tree_mask"][:raw].copy_(self._causal if step.tree_mask is None
                                       else step.tree_mask)
        if raw < bucket:
            # Overwritten on every replay, whatever an earlier (bigger) batch left there.
            for name, buf in b.items():
                buf[raw:bucket] = self._fills[name]
        return StagedViews(b["input_ids"][:bucket].view(-1), b["positions"][:bucket].view(-1),
                           b["out_slots"][:bucket].view(-1), b["rows"][:bucket],
                           b["seq_lens"][:bucket], b["tree_mask"][:bucket], raw, bucket, self.q)


def static_attention(rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                     table: torch.Tensor, max_kv: int) -> AttentionMetadata:
    """The attention metadata of a staged batch (``StagedViews`` fields), at a fixed key width
    ``max_kv``: the cached prefix ``[0, seq_len - q)`` is visible to every new token, the block
    of new tokens follows the tree mask (``visible_keys``). Padded rows (row 0, length q,
    first-column tree mask) see the dummy slot only."""
    return AttentionMetadata.over_blocks(table, rows, seq_lens - tree_mask.shape[1], max_kv,
                                         tree_mask)
