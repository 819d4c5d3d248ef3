"""Memory and lifecycle invariants the suite checks from outside, after every step, over the
contract's ``MemoryView``: M1 conservation, M2 bounds, M3 sequential length, M4 idle, M5
sessions closed; and that the view's pages are the size the backend was asked for.

The suite's own code: the reference engine states M1/M2 for its internal strict check, but an
oracle shares no code with the engine it judges. M3 needs the suite's record of what each
request emitted, and M5 closes the session story.
"""

from __future__ import annotations

from conformance.contract import MemoryView


class InvariantError(AssertionError):
    """An invariant failed; the message names it, the request and the numbers."""


def _paged(tokens: int, page_size: int) -> int:
    """Slots a request's ``tokens`` occupy: whole pages."""
    pages = (tokens + page_size - 1) // page_size
    return pages * page_size


def kv_held(view: MemoryView, rid: str) -> int:
    """Positions ``rid`` holds slots for in ``view``: 0 for a request the view leaves out or
    lists with zero KV (the contract allows either for one that waits)."""
    kv = view.requests.get(rid)
    return 0 if kv is None else kv.allocated


def conservation_error(view: MemoryView) -> str | None:
    """M1: every slot is free, held, or owned by exactly one live request."""
    owned = sum(_paged(kv.allocated, view.page_size) for kv in view.requests.values())
    accounted = view.free + view.held + owned
    if accounted == view.capacity:
        return None
    return (f"M1 conservation: free {view.free} + held {view.held} + owned {owned} "
            f"!= capacity {view.capacity}")


def bounds_error(view: MemoryView) -> str | None:
    """M2: 0 <= committed <= allocated <= committed + reserve_bound, per request."""
    for rid in sorted(view.requests):
        kv = view.requests[rid]
        ahead = kv.allocated - kv.committed
        if kv.committed < 0 or ahead < 0:
            return f"M2 bounds: request {rid!r} committed {kv.committed} allocated {kv.allocated}"
        if ahead > view.reserve_bound:
            return (f"M2 bounds: request {rid!r} reserves {ahead} tokens beyond its committed "
                    f"{kv.committed} (bound {view.reserve_bound})")
    return None


def idle_error(view: MemoryView) -> str | None:
    """M4: with no live request, nothing but held KV may be in use (slots and request rows)."""
    slots = view.capacity - view.free - view.held
    rows = view.rows_capacity - view.rows_free - view.rows_held
    found = [
        (bool(view.requests), f"live requests remain: {sorted(view.requests)}"),
        (slots != 0, f"free {view.free} + held {view.held} != capacity {view.capacity} "
                     f"({slots} slots leaked)"),
        (rows != 0, f"rows free {view.rows_free} + held {view.rows_held} != "
                    f"{view.rows_capacity} ({rows} request rows leaked)"),
    ]
    return next((f"M4 idle: {message}" for broken, message in found if broken), None)


def sequential_length_error(view: MemoryView, prompt_lens: dict[str, int],
                            output_lens: dict[str, int], overlap: bool = False) -> str | None:
    """M3: a decoding request holds KV for exactly prompt + output - 1 tokens (the newest
    token gets its KV in the next forward). Under overlap scheduling a request whose step is in
    flight has pre-claimed that token's slot, so prompt + output is allowed too."""
    for rid, r in sorted(view.requests.items()):
        if r.phase != "decode" or rid not in prompt_lens:
            continue
        expected = prompt_lens[rid] + output_lens.get(rid, 0) - 1
        if r.committed != expected and not (overlap and r.committed == expected + 1):
            allowed = f"{expected} or {expected + 1} (overlap)" if overlap else f"{expected}"
            return (f"M3 sequential length: request {rid!r} committed {r.committed}, expected "
                    f"prompt {prompt_lens[rid]} + output {output_lens.get(rid, 0)} - 1 = "
                    f"{allowed}")
    return None


def sessions_closed_error(view: MemoryView) -> str | None:
    """M5: with every session closed, the whole pool is free."""
    if view.free != view.capacity:
        return f"M5 sessions closed: free {view.free} != capacity {view.capacity}"
    return None


def page_size_error(view: MemoryView, asked: int | None) -> str | None:
    """The view's pages are the size the backend was opened with (``OpenConfig.page_size``,
    which the suite has already rounded up to the backend's ``page_multiple``); None: the
    backend chose, nothing to compare."""
    if asked is None or view.page_size == asked:
        return None
    return (f"page size: the memory view reports page_size {view.page_size}, but the backend "
            f"was opened with page_size {asked} (a backend that cannot honour a page size "
            "declares Capabilities.page_multiple; docs/adapter.md)")


def check_busy(view: MemoryView, prompt_lens: dict[str, int], output_lens: dict[str, int],
               where: str, overlap: bool = False) -> None:
    problem = (conservation_error(view) or bounds_error(view)
               or sequential_length_error(view, prompt_lens, output_lens, overlap))
    if problem:
        raise InvariantError(f"{where}: {problem}")


def check_idle(view: MemoryView, where: str, sessions_closed: bool = True) -> None:
    problem = idle_error(view) or (sessions_closed_error(view) if sessions_closed else None)
    if problem:
        raise InvariantError(f"{where}: {problem}")
