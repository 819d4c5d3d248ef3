"""Req: one generation request, its token history, KV lengths and finish state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from refengine.config import SamplingParams
from specwire.events import FinishReason


class ReqStatus(enum.Enum):
    WAITING = "waiting"      # queued, or retracted and waiting to re-prefill
    PREFILL = "prefill"      # holds KV for a prefix of its fill ids (chunked prefill)
    DECODE = "decode"        # prompt (and any earlier output) fully in KV
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int                       # admission order; retraction picks the newest first
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    row: int | None = None             # row in ReqToTokenPool while it holds KV
    kv_committed_len: int = 0          # positions whose KV is written
    kv_allocated_len: int = 0          # positions with a reserved slot
    retractions: int = 0
    accept_lens: list[int] = field(default_factory=list)  # tokens emitted per verify step
    session_id: str | None = None      # a streaming session's turn: keeps its KV at finish
    cached_prefix: int = 0             # positions whose KV it inherited from earlier turns

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV a (re-)prefill writes: the prompt plus any output so far.

        The prefill then samples the next token, which gets its KV in the following forward,
        so afterwards ``kv_committed_len == seq_len - 1`` (invariant M3). A retracted
        request re-prefills its output too and so resumes exactly where it stopped.
        """
        return self.prompt_ids + self.output_ids

    @property
    def kv_phase(self) -> Literal["prefill", "decode"]:
        return "decode" if self.status is ReqStatus.DECODE else "prefill"

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
