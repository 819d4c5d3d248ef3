"""DraftState: the running batch's per-request draft state (EAGLE's ``DraftInput``, Frozen-KV
MTP's ``SeedInput``, a standalone draft model's ``CatchUpInput``, n-gram lookup's
``NgramInput``) and which request each row belongs to.

Rows follow the batch: ``aligned`` filters them to the requests about to decode (in that
order), ``drop`` removes a request that finished, aborted or was retracted, ``add`` merges the
rows of newly prefilled requests, ``install`` replaces the state after a decode step. Only a
per-request state may be installed (never a ``VerifyInput``): those are the phase types with
``filter_batch``/``merge_batch``.
"""

from __future__ import annotations

from refengine.device import from_host
from refengine.speculative.inputs import CatchUpInput, DraftInput, NgramInput, SeedInput

# what a worker keeps per request between steps
RowState = DraftInput | SeedInput | CatchUpInput | NgramInput


class DraftState:
    def __init__(self, idle: RowState) -> None:
        self.rids: list[str] = []
        self.draft_input = idle

    def _keep(self, keep: list[int]) -> None:
        self.draft_input = self.draft_input.filter_batch(from_host(keep,
                                                                   self.draft_input.device))
        self.rids = [self.rids[i] for i in keep]

    def add(self, rids: list[str], rows: RowState) -> None:
        self.draft_input = self.draft_input.merge_batch(rows)
        self.rids = self.rids + list(rids)

    def drop(self, rid: str) -> None:
        if rid in self.rids:
            self._keep([i for i, r in enumerate(self.rids) if r != rid])

    def aligned(self, rids: list[str]) -> RowState:
        if rids == self.rids:
            return self.draft_input  # already aligned: the common step, no copy
        index = {r: i for i, r in enumerate(self.rids)}
        missing = [r for r in rids if r not in index]
        if missing:
            raise RuntimeError(f"draft state has no row for decoding requests {missing}")
        self._keep([index[r] for r in rids])
        return self.draft_input

    def install(self, rids: list[str], draft_input: RowState) -> None:
        self.rids = list(rids)
        self.draft_input = draft_input
