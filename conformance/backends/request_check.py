"""What a run-to-completion backend (hf, ctranslate2) checks when a request is submitted: the
adapter's ValueError contract, each message starting with the field it names."""

from __future__ import annotations

from collections.abc import Iterable

from conformance.contract import Request


def check_request(req: Request, live: Iterable[str], vocab_size: int, max_context_len: int,
                  backend: str) -> None:
    """ValueError unless ``req`` can run: no session, a new rid, a non-empty prompt of token ids
    in the vocabulary, leaving room in the context for at least one new token."""
    if req.session_id is not None:
        raise ValueError(f"session_id: the {backend} backend has no streaming sessions")
    if req.rid in live:
        raise ValueError(f"rid: request {req.rid!r} is already live")
    ids = req.prompt_ids
    if not ids:
        raise ValueError("prompt: empty (at least one token is needed)")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt: token id {t!r} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")
    if len(ids) >= max_context_len:
        raise ValueError(f"prompt: {len(ids)} tokens exceed the context length "
                         f"{max_context_len} (room for at least one new token needed)")
