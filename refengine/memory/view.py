"""The conservation checks every step must keep over a ``MemoryView`` (the wire type, defined
in ``specwire``): the engine's own strict check (M6 asserts M1/M2 inside the engine). The
conformance suite checks M1-M5 from outside with its own code (``conformance/checks``).
"""

from __future__ import annotations

from specwire.memory import MemoryView, ReqKV

__all__ = ["MemoryView", "ReqKV", "bounds_error", "ceil_page", "conservation_error", "idle_error"]


def ceil_page(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def conservation_error(view: MemoryView) -> str | None:
    """M1: every slot is free, held, or owned by exactly one live request."""
    owned = sum(ceil_page(r.allocated, view.page_size) for r in view.requests.values())
    if view.free + view.held + owned != view.capacity:
        return (f"M1 conservation: free {view.free} + held {view.held} + owned {owned} "
                f"!= capacity {view.capacity}")
    return None


def bounds_error(view: MemoryView) -> str | None:
    """M2: 0 <= committed <= allocated <= committed + reserve_bound, per request."""
    for rid, r in sorted(view.requests.items()):
        if not 0 <= r.committed <= r.allocated:
            return f"M2 bounds: request {rid!r} committed {r.committed} allocated {r.allocated}"
        if r.allocated - r.committed > view.reserve_bound:
            return (f"M2 bounds: request {rid!r} reserves {r.allocated - r.committed} tokens "
                    f"beyond its committed {r.committed} (bound {view.reserve_bound})")
    return None


def idle_error(view: MemoryView) -> str | None:
    """M4: with no live request, nothing but held KV may be in use."""
    if view.requests:
        return f"M4 idle: live requests remain: {sorted(view.requests)}"
    if view.free + view.held != view.capacity:
        return (f"M4 idle: free {view.free} + held {view.held} != capacity {view.capacity} "
                f"({view.capacity - view.free - view.held} slots leaked)")
    if view.rows_free + view.rows_held != view.rows_capacity:
        return (f"M4 idle: rows free {view.rows_free} + held {view.rows_held} != "
                f"{view.rows_capacity} ({view.rows_capacity - view.rows_free - view.rows_held} "
                "request rows leaked)")
    return None
