"""Finish conditions checked after every emitted token."""

from __future__ import annotations

from collections.abc import Callable

from refengine.config import SamplingParams
from refengine.request import FinishReason


def finish_reason(params: SamplingParams, output_ids: list[int], seq_len: int, eos_token_id: int,
                  max_context_len: int, decode: Callable[[list[int]], str]) -> FinishReason | None:
    """Why a request stops after emitting ``output_ids[-1]`` (already appended), or None."""
    token = output_ids[-1]
    if token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos):
        return "stop"
    if params.stop and stop_string_cut(decode(output_ids), params.stop) is not None:
        return "stop"
    if len(output_ids) >= params.max_new_tokens or seq_len >= max_context_len:
        return "length"
    return None


def stop_string_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
