"""A Ctrl-C that lands in a garbage-collector callback is raised again in ordinary code
(``conformance.run.interrupt_redelivery``); without the hook the interpreter swallows it."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator

import pytest

from conformance.run import interrupt_redelivery


@pytest.fixture
def interrupt_in_next_gc() -> Iterator[list[bool]]:
    """Once the test arms it (appends to the list it is handed), the next collection runs a
    callback that raises KeyboardInterrupt, as a SIGINT handler does when the signal arrives
    while Python code of a gc callback runs. Automatic collection is off meanwhile, and the
    callback fires only once armed, so the collection it fires in is the test's own
    ``gc.collect()``: any other between this setup and the test body (the allocator's, or an
    explicit one elsewhere in the process, now and then on a loaded machine) would fire it
    before the test installed its hook."""
    fired: list[bool] = []
    armed: list[bool] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and armed and not fired:
            fired.append(True)
            raise KeyboardInterrupt

    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(callback)
    before = sys.unraisablehook
    try:
        yield armed
    finally:
        gc.callbacks.remove(callback)
        sys.unraisablehook = before
        if was_enabled:
            gc.enable()


def wait_for_interrupt(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(0.001)
    except KeyboardInterrupt:
        return True
    return False


def test_an_interrupt_swallowed_by_gc_is_raised_again(interrupt_in_next_gc: list[bool]
                                                       ) -> None:
    interrupt_redelivery.keep_interrupts()
    interrupt_in_next_gc.append(True)
    gc.collect()  # the callback's KeyboardInterrupt cannot propagate out of the collector
    assert wait_for_interrupt(5.0)


def test_without_the_hook_the_interrupt_is_lost(interrupt_in_next_gc: list[bool]) -> None:
    sys.unraisablehook = lambda unraisable: None  # what a bare interpreter does, minus the print
    interrupt_in_next_gc.append(True)
    gc.collect()
    assert not wait_for_interrupt(0.5)


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
