"""A Ctrl-C that lands in a garbage-collector callback is raised again in ordinary code
(``conformance.run.interrupt_redelivery``); without the hook the interpreter swallows it."""

from __future__ import annotations

import subprocess
import sys

from conformance.run import interrupt_redelivery

# A fresh interpreter, so nothing an earlier test in the same worker left behind (threads,
# hooks, gc state) stands between the collection and the interrupt. Automatic collection is
# off, so the one collection is the script's own; its gc callback raises KeyboardInterrupt
# once, as a SIGINT handler does when the signal arrives while Python code of a gc callback
# runs. The script prints whether the interrupt then reached ordinary code within the wait.
GC_INTERRUPT_SCRIPT = """
import gc, signal, sys, time
from conformance.run import interrupt_redelivery

# Python's own Ctrl-C handler, as in a terminal: a runner that starts its children with SIGINT
# ignored (tox does) makes _thread.interrupt_main a no-op, and there is no Ctrl-C to keep
signal.signal(signal.SIGINT, signal.default_int_handler)

fired = []
def callback(phase, info):
    if phase == "start" and not fired:
        fired.append(True)
        raise KeyboardInterrupt

gc.disable()
if sys.argv[1] == "hook":
    interrupt_redelivery.keep_interrupts()
else:
    sys.unraisablehook = lambda unraisable: None  # a bare interpreter, minus the print
gc.callbacks.append(callback)
gc.collect()
deadline = time.monotonic() + float(sys.argv[2])
try:
    while time.monotonic() < deadline:
        time.sleep(0.001)
except KeyboardInterrupt:
    print("interrupted")
else:
    print("lost")
"""


def interrupt_after_gc(mode: str, wait_s: float) -> str:
    """Run the script with the hook (``mode`` "hook") or without; -> what it printed."""
    done = subprocess.run([sys.executable, "-c", GC_INTERRUPT_SCRIPT, mode, str(wait_s)],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_an_interrupt_swallowed_by_gc_is_raised_again() -> None:
    assert interrupt_after_gc("hook", 5.0) == "interrupted"


def test_without_the_hook_the_interrupt_is_lost() -> None:
    assert interrupt_after_gc("bare", 0.5) == "lost"


def test_other_unraisable_exceptions_reach_the_previous_hook() -> None:
    seen: list[type[BaseException] | None] = []
    before = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_type)
    try:
        interrupt_redelivery.keep_interrupts()

        class Noisy:
            def __del__(self) -> None:
                raise ValueError("from __del__")

        Noisy()
        assert seen == [ValueError]
    finally:
        sys.unraisablehook = before


def test_after_a_session_restores_its_hook_the_outer_wrapper_reaches_the_original() -> None:
    """The CLI wraps the interpreter's hook; a pytest session installs its own, which the
    session's wrapper wraps, and restores the CLI's at its end: that one must still pass
    exceptions to the interpreter's hook, not to the finished session's."""
    seen: list[str] = []
    before = sys.unraisablehook
    try:
        sys.unraisablehook = lambda unraisable: seen.append("original")
        interrupt_redelivery.keep_interrupts()              # the CLI
        cli_hook = sys.unraisablehook
        sys.unraisablehook = lambda unraisable: seen.append("session")  # pytest's configure
        interrupt_redelivery.keep_interrupts()              # the session's wrapper
        sys.unraisablehook = cli_hook                       # pytest's cleanup

        class Noisy:
            def __del__(self) -> None:
                raise ValueError("from __del__")

        Noisy()
        assert seen == ["original"]
    finally:
        sys.unraisablehook = before
