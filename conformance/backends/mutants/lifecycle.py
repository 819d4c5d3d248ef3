"""Mutants of the request lifecycle outside speculation: length and stop checks, the finish
text's stop-string cut, the request seed, attention that sees across batch rows."""

from __future__ import annotations

import zlib
from dataclasses import replace

import torch

from refengine import Engine
from refengine.events import Event, FinishEvent
from refengine.model.attention import AttentionMetadata
from refengine.output import OutputProcessor
from refengine.request import FinishReason, Req
from refengine.runner import ModelRunner
from refengine.scheduler import Scheduler
from refengine.stopping import finish_reason


class _LengthOffByOne(OutputProcessor):
    def finish_reason(self, req: Req) -> FinishReason | None:
        reason = super().finish_reason(req)
        if reason == "length" and len(req.output_ids) == req.params.max_new_tokens:
            return None
        return reason


class MaxNewTokensOffByOne(Engine):
    """The length limit is compared with ``>`` instead of ``>=``: one token too many."""

    output_class = _LengthOffByOne


def _finish_reason_without(out: OutputProcessor, req: Req, **dropped: tuple[()]
                           ) -> FinishReason | None:
    """The reference finish check with some of the request's stop conditions dropped."""
    return finish_reason(replace(req.params, **dropped), req.output_ids, req.seq_len,
                         out.eos_token_id, out.max_context_len, out.decode)


class _DropsStopTokenIds(OutputProcessor):
    def finish_reason(self, req: Req) -> FinishReason | None:
        return _finish_reason_without(self, req, stop_token_ids=())


class IgnoresStopTokenIds(Engine):
    """``stop_token_ids`` is dropped on the way to the finish check (EOS still works)."""

    output_class = _DropsStopTokenIds


class _CutsAtFirstListedString(OutputProcessor):
    def finish(self, req: Req, reason: FinishReason, events: list[Event]) -> None:
        super().finish(req, reason, events)
        if reason != "stop" or not req.params.stop:
            return
        text = self.decode(req.output_ids)
        # BUG: the first listed stop string that occurs, not the earliest one in the text
        cut = next((i for i in (text.find(s) for s in req.params.stop) if i >= 0), None)
        finished = events[-1]  # the reference's finish appends its FinishEvent last
        assert isinstance(finished, FinishEvent)
        if cut is not None:
            events[-1] = replace(finished, text=text[:cut])


class StopAtFirstListedString(Engine):
    """The finish text is cut before the first listed stop string that occurs in it instead of
    the earliest one in the text: where several complete at one token, too much text is
    reported (the tokens and the finish are right)."""

    output_class = _CutsAtFirstListedString


class _DropsRequestSeed(Scheduler):
    def add(self, req: Req) -> None:
        # BUG: the request's own seed is lost on the way in; it draws as an unseeded request
        # would, from a seed derived from its request id.
        req.seed = zlib.crc32(req.rid.encode()) % (2**31)
        super().add(req)


class SeedIgnored(Engine):
    """A per-request seed is silently ignored: every request draws from a seed derived from its
    request id. Draws stay independent and correctly distributed; only reproducibility breaks."""

    scheduler_class = _DropsRequestSeed


class _LongestMaskRunner(ModelRunner):
    def attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                           seq_lens: list[int], masks: list[torch.Tensor] | None = None
                           ) -> AttentionMetadata:
        meta = super().attention_metadata(rows, extend_lens, seq_lens, masks)
        if masks is not None:  # speculative tree masks: this bug lives in plain batches
            return meta
        longest = max(seq_lens)
        for b, n in enumerate(extend_lens):
            meta.mask[b, 0, :n, :longest - n] = True  # every cached position "visible"
        return meta


class BatchLeaksAcrossRows(Engine):
    """Keys are masked by the batch's longest length instead of each request's own, so a
    short request attends to stale slots of its row: output depends on its batch-mates."""

    runner_class = _LongestMaskRunner
