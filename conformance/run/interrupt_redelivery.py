"""Ctrl-C must not be lost inside a garbage-collector callback.

Python raises ``KeyboardInterrupt`` from its SIGINT handler at the next bytecode boundary of
the main thread, wherever that is. When that is Python code run by the garbage collector (a
``gc.callbacks`` entry, such as the one Hypothesis registers and runs around the
``gc.collect()`` it does before every example, or a ``__del__``), the interpreter cannot
propagate the exception: it reports it as "unraisable" and carries on, and the run goes on to
the end as if nobody had pressed anything (on a loaded machine this happens often enough to
matter: docs/measurements.md).

The hook installed here sees such a swallowed ``KeyboardInterrupt`` and delivers it again
(``_thread.interrupt_main``: the same pending-signal path a real SIGINT takes) from a helper
thread, so the main thread meets it after the hook has returned: raised inside the hook, it
would be swallowed once more. If it lands in a gc callback again, the hook sends it again, until
it is raised in ordinary code. Every other unraisable exception goes to the hook that was there
before (pytest installs one per session: ``keep_interrupts`` must run after it).
"""

from __future__ import annotations

import _thread
import sys
import time
from collections.abc import Callable
from typing import Any

# The helper thread waits this long before it interrupts the main thread, which by then has
# left the hook (the hook returns right after starting it).
REDELIVERY_DELAY_S = 0.01


def _interrupt_main_soon() -> None:
    time.sleep(REDELIVERY_DELAY_S)
    _thread.interrupt_main()


class _RedeliverInterrupts:
    """An unraisable hook: a swallowed Ctrl-C is sent again, anything else goes on to the hook
    it replaced (its own: a pytest session installs and later restores one of its own around
    it, and each wrapper keeps the one it saw)."""

    def __init__(self, previous: Callable[[Any], object]) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type,
                                                          KeyboardInterrupt):
            # _thread, not threading: Thread.start() waits for the thread to run, and an
            # interrupt raised during that wait, inside this hook, would be swallowed for good
            _thread.start_new_thread(_interrupt_main_soon, ())
            return
        self.previous(unraisable)


def keep_interrupts() -> None:
    """Install the hook in this process, around the current one (once: a no-op when the current
    hook already is one)."""
    if not isinstance(sys.unraisablehook, _RedeliverInterrupts):
        sys.unraisablehook = _RedeliverInterrupts(sys.unraisablehook)
