"""DecodeReservation: the KV a decode step holds past a request's committed end.

The scheduler reserves it for every request of a decode batch before launch (through
``KVManager.reserve``), so the step's forwards only write into slots they were given; resolve
commits what the step kept and, in a sequential step, frees the rest.

One name per quantity:

* ``reach``: positions past the committed end a decode step may write: its ``block`` (1 for
  plain decoding, the verify block for a sequential speculative step, ``1 + 2L`` under overlap
  scheduling) or a drafter's ``scratch`` (a sequential step's draft KV past the root),
  whichever is longer;
* the *top-up* (``KVManager.top_up``): positions a request's allocation must still grow by to
  hold its reservation, what the scheduler finds room for or retracts;
* ``reserve_bound`` (``MemoryView``): the most a request may hold past its committed end
  *between* steps (0 unless the reservation outlives the step, as under overlap scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.memory.view import ceil_page


@dataclass(frozen=True)
class DecodeReservation:
    block: int
    scratch: int = 0
    # Overlap scheduling keeps the reservation between steps and tops it up in whole pages;
    # its root's slot is committed at schedule time (every verify commits the root), so a
    # step launched before the previous one is resolved never allocates.
    page_aligned: bool = False
    preclaim_root: bool = False

    @property
    def reach(self) -> int:
        return max(self.block, self.scratch)

    def end(self, committed: int, page_size: int) -> int:
        """The allocation a request with ``committed`` positions holds for its next step."""
        end = committed + self.reach
        return ceil_page(end, page_size) if self.page_aligned else end


PLAIN_DECODE = DecodeReservation(1)  # a plain decode step writes its one new token
