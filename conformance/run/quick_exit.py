"""Leave a process at once after Ctrl-C, skipping the interpreter's teardown.

Once an interrupted run has kept what it keeps (the CLI: the certificate and its one line; an
xdist worker: every finished check's report, already sent), all that is left at exit is
Python's finalisation: every module's objects freed and, with torch loaded, its C++ static
destructors. The xdist controller waits for each worker's end before it can write the
certificate, so that teardown decides whether Ctrl-C comes back within seconds
(docs/measurements.md). None of it is needed: files are closed and the streams are flushed
here first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then end the process without finalisation."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe has nothing to flush
            stream.flush()
    os._exit(code)


class WorkerInterruptExit:
    """A pytest plugin for an xdist worker: after an interrupted session the worker ends as soon
    as the atexit handlers registered after it have run (the backend's among them: a backend is
    loaded after the plugins are configured), instead of tearing the interpreter down first."""

    def __init__(self) -> None:
        self.interrupted = False
        atexit.register(self._exit_if_interrupted)

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True

    def _exit_if_interrupted(self) -> None:
        if self.interrupted:
            exit_now(0)  # the status Python gives a worker whose session ended by Ctrl-C
