"""The draft loops' static buffers: one leading row per request, allocated once at the largest
bucket, a bucket's view a contiguous prefix (stable addresses across replays), restaged in full
before every replay; ``LOOP_FIELDS`` says, per loop kind and buffer, what a padded request's
entry holds and why that is harmless (every padded row reads and writes only the reserved
dummy row/slot and computes finite values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.graph.staging import DUMMY_ROW, DUMMY_SLOT


@dataclass(frozen=True)
class LoopField:
    """One staged buffer of a draft loop: per-request shape and dtype, and what a padded
    request's entry holds (and why that is harmless)."""

    tail: tuple[str, ...]      # per-request shape, by name: "k", "H", "scratch", "N"
    dtype: str                 # "int64", "float32", "hidden" (the model's dtype)
    fill: float
    why: str


_TOKEN = LoopField((), "int64", 0, "token 0 is in every vocabulary: the embedding gather stays "
                   "in bounds; the row's outputs are sliced away")
_HIDDEN = LoopField(("H",), "hidden", 0.0, "finite, so nothing a padded row computes is NaN "
                    "(a NaN written to the dummy page would be read back by every padded row)")
_DUMMY_PAGE = ("the padded rows' draft KV lands in the reserved page, which no request "
               "owns")
_ROWS = LoopField((), "int64", DUMMY_ROW, "the reserved row is never written, so every key "
                  "slot gathered through it is the dummy slot; a stale real row here would read "
                  "another request's KV")

LOOP_FIELDS: dict[str, dict[str, LoopField]] = {
    "draft:eagle": {
        "topk_p": LoopField(("k",), "float32", 1.0, "finite path scores"),
        "topk_index": LoopField(("k",), "int64", 0, _TOKEN.why),
        "hidden": _HIDDEN,
        "rows": _ROWS,
        "roots": LoopField((), "int64", 0, "no prefix: the scratch block starts at column 0 of "
                           "the dummy row, whose every slot is the dummy slot"),
        "scratch": LoopField(("scratch",), "int64", DUMMY_SLOT, _DUMMY_PAGE),
    },
    "extend:eagle": {
        "ids": LoopField(("N",), "int64", 0, _TOKEN.why),
        "hidden": LoopField(("N", "H"), "hidden", 0.0, _HIDDEN.why),
        "rows": _ROWS,
        "ends": LoopField((), "int64", 1, "the kept query sits at position 0 and sees column 0 "
                          "of the dummy row only"),
        "slots": LoopField(("N",), "int64", DUMMY_SLOT, _DUMMY_PAGE),
    },
    "step:eagle-chain": {
        "topk_p": LoopField(("k",), "float32", 1.0, "finite path scores"),
        "topk_index": LoopField(("k",), "int64", 0, _TOKEN.why),
        "hidden": _HIDDEN,
        "verified_id": _TOKEN,
        "rows": _ROWS,
        "roots": LoopField((), "int64", 0, "no prefix: the scratch and verify block start at "
                           "column 0 of the dummy row, whose every slot is the dummy slot"),
        "slots": LoopField(("N",), "int64", DUMMY_SLOT, _DUMMY_PAGE + " (the draft's scratch, "
                           "the verify block and the extend all write there)"),
    },
    "step:mtp-chain": {
        "bonus_tokens": _TOKEN,
        "hidden": _HIDDEN,
        "rows": _ROWS,
        "roots": LoopField((), "int64", 1, "the draft's query sits at position 0 and sees "
                           "column 0 of the dummy row only (a length of 0 would leave it no "
                           "key: an all-masked softmax); the verify block follows it there"),
        "slots": LoopField(("N",), "int64", DUMMY_SLOT, _DUMMY_PAGE),
    },
    "draft:mtp": {
        "bonus_tokens": _TOKEN,
        "hidden": _HIDDEN,
        "rows": _ROWS,
        "seq_lens": LoopField((), "int64", 1, "a one-position prefix: the query sits at "
                              "position 0 and sees column 0 of the dummy row only"),
    },
}


class LoopStaging:
    """Max-size static buffers for one draft loop, one leading row per request, allocated once;
    a bucket's view is a contiguous prefix (stable addresses across replays)."""

    def __init__(self, kind: str, max_bs: int, sizes: dict[str, int], hidden_dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.kind, self.max_bs = kind, max_bs
        self.fields = LOOP_FIELDS[kind]
        dtypes = {"int64": torch.int64, "float32": torch.float32, "hidden": hidden_dtype}
        self.buffers = {name: torch.full((max_bs, *(sizes[d] for d in f.tail)), f.fill,
                                         dtype=dtypes[f.dtype], device=device)
                        for name, f in self.fields.items()}

    def stage(self, inputs: dict[str, torch.Tensor] | None, bucket: int
              ) -> dict[str, torch.Tensor]:
        """Copy ``inputs`` (every field, ``raw`` rows) into rows ``[:raw]`` and the fill into
        ``[raw:bucket]``, every buffer on every replay; ``None`` stages padding only."""
        raw = 0 if inputs is None else next(iter(inputs.values())).shape[0]
        if not 0 <= raw <= bucket <= self.max_bs:
            raise ValueError(f"staging {raw} requests into bucket {bucket} "
                             f"(buffers hold {self.max_bs})")
        if inputs is not None and set(inputs) != set(self.fields):
            raise ValueError(f"{self.kind}: inputs {sorted(inputs)}, expected "
                             f"{sorted(self.fields)}")
        for name, buf in self.buffers.items():
            self.restage(name, buf, None if inputs is None else inputs[name], raw, bucket)
        return {name: buf[:bucket] for name, buf in self.buffers.items()}

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        """One buffer's real rows and padding (an extension point: the bug zoo skips one)."""
        if value is not None:
            buf[:raw].copy_(value)
        if raw < bucket:  # a full bucket has no padded rows: skip the empty fill's dispatch
            buf[raw:bucket] = self.fields[name].fill
