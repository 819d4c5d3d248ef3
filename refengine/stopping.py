"""Finish conditions checked after every emitted token."""

from __future__ import annotations

from collections.abc import Callable

from refengine.request import FinishReason, Req


def finish_reason(req: Req, token: int, eos_token_id: int, max_context_len: int,
                  decode: Callable[[list[int]], str]) -> FinishReason | None:
    """Why ``req`` stops after emitting ``token`` (already appended), or None."""
    p = req.params
    if token in p.stop_token_ids or (token == eos_token_id and not p.ignore_eos):
        return "stop"
    if p.stop and stop_string_cut(decode(req.output_ids), p.stop) is not None:
        return "stop"
    if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= max_context_len:
        return "length"
    return None


def stop_string_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
