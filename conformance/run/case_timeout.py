"""A per-case timeout: a backend that hangs fails the check it hangs in, and the run goes on.

Each phase of a suite check (setup, the check itself, teardown) gets ``--specgate-case-timeout``
seconds. Past that, SIGALRM raises ``CaseTimeout`` in the main thread wherever Python code runs,
and again every ``repeat_interval`` while the phase lasts, so a cleanup that hangs as well is cut
short too. The driver adds which backend call was running
(``conformance.repro.driver.backend_call``).

Code that never returns to Python (a native loop, a call that ignores signals) cannot be stopped
from inside the process. In an xdist worker the native watchdog
(``conformance.run.native_watchdog``) then ends the worker ``native_grace`` seconds later; xdist
reports the case as crashed and starts a fresh worker, so the certificate still lists it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

from conformance.plan.profiles import PROFILES
from conformance.plan.usage import CaseTimeout
from conformance.run.native_watchdog import NativeWatchdog

DEFAULT_SECONDS = {name: p.case_timeout for name, p in PROFILES.items()}  # seconds per phase


def default_seconds(profile: str, graph_executor: str | None) -> float:
    """The profile's seconds times the executor's timeout factor (the executor registry's:
    executors that compile do it inside the first checks that meet each shape)."""
    from refengine.graph.executors import EXECUTORS

    info = EXECUTORS.get(graph_executor or "")
    return DEFAULT_SECONDS[profile] * (1 if info is None else info.timeout_factor)


def repeat_interval(seconds: float) -> float:
    return min(seconds, 5.0)


def native_grace(seconds: float) -> float:
    """How much longer than the timeout the native watchdog waits: Python code gets the
    timeout's exception first, and its cleanup one more chance."""
    return max(2.0, seconds / 2)


class CaseDeadline:
    """A pytest plugin timing every phase of each suite check (items with a tier marker)."""

    def __init__(self, seconds: float, watchdog: NativeWatchdog | None = None) -> None:
        self.seconds = seconds
        self.watchdog = watchdog
        self.phase = ""  # the phase being timed; empty between phases (the alarm then waits)

    def _alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.phase:
            raise CaseTimeout(f"case timeout: no return within {self.seconds:g} s "
                              f"({self.phase} of the check)")

    @contextmanager
    def timing(self, item: pytest.Item, phase: str) -> Iterator[None]:
        if (self.seconds <= 0 or not item.get_closest_marker("specgate_tier")
                or threading.current_thread() is not threading.main_thread()):
            yield
            return
        previous = signal.signal(signal.SIGALRM, self._alarm)
        self.phase = phase
        signal.setitimer(signal.ITIMER_REAL, self.seconds, repeat_interval(self.seconds))
        if self.watchdog is not None:
            self.watchdog.arm(f"{item.nodeid} ({phase})",
                              self.seconds + native_grace(self.seconds))
        try:
            yield
        finally:
            self.phase = ""  # first: an alarm arriving from here on raises nothing
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if self.watchdog is not None:
                self.watchdog.cancel()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        with self.timing(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        with self.timing(item, "run"):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        with self.timing(item, "teardown"):
            return (yield)
