"""A replay's first divergence: where it went wrong, what was expected and what came, with
the memory view around it, as one block of text (what a repro prints and a fuzz failure
raises)."""

from __future__ import annotations

from dataclasses import dataclass

from conformance.contract import MemoryView


@dataclass(frozen=True)
class Divergence:
    """Where a replay first went wrong, as one block of text (``describe``)."""

    run: int
    action_index: int       # into the run's actions; -1: opening the backend;
    #                         len(actions): the steps that run it to completion
    action: str
    step: int               # the step it went wrong in (or the last one before the action)
    rid: str | None
    expected: str
    came: str
    memory_before: str | None = None
    memory_after: str | None = None

    def describe(self) -> str:
        where = ("opening the backend" if self.action_index < 0 else
                 f"actions[{self.action_index}] ({self.action})")
        lines = [f"first divergence: run {self.run}, {where}, step {self.step}"
                 + (f", request {self.rid!r}" if self.rid else ""),
                 f"  expected: {self.expected}", f"  came:     {self.came}"]
        if self.memory_before is not None or self.memory_after is not None:
            lines += [f"  memory before: {self.memory_before or '(not read)'}",
                      f"  memory after:  {self.memory_after or '(not read)'}"]
        return "\n".join(lines)


class Diverged(AssertionError):
    """Raised by ``ActionRunner``; the message is the divergence block."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.describe())
        self.divergence = divergence


def show_memory(view: MemoryView) -> str:
    """The memory view in one line, as a divergence shows it before and after."""
    rows = ", ".join(f"{rid}: {kv.committed}/{kv.allocated} {kv.phase}"
                     for rid, kv in sorted(view.requests.items()))
    return (f"capacity {view.capacity}, free {view.free}, held {view.held}, page "
            f"{view.page_size}; rows {view.rows_capacity - view.rows_free - view.rows_held}"
            f"/{view.rows_capacity} in use; requests (committed/allocated): {rows or 'none'}")


def raised_text(err: BaseException) -> str:
    """An exception as a divergence's "came" names it: its type, message and notes."""
    notes = "; ".join(getattr(err, "__notes__", []))
    return f"{type(err).__name__}: {err}" + (f" ({notes})" if notes else "")
