"""Memory and lifecycle invariants the suite checks from outside, after every step.

M1 (conservation), M2 (bounds) and M4 (idle) are the reference engine's own definitions
(refengine.memory.view), so the engine's strict check and the suite cannot drift apart; M3
needs the suite's record of what each request emitted, and M5 closes the session story.
"""

from __future__ import annotations

from refengine.memory.view import MemoryView, bounds_error, conservation_error, idle_error


class InvariantError(AssertionError):
    """An invariant failed; the message names it, the request and the numbers."""


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
