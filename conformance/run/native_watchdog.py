"""The last resort against a backend stuck in native code: end the xdist worker.

A hang that never returns to Python (a native loop, a call that ignores signals, a native call
holding the GIL) defeats the per-case timeout's exception and any Python watchdog thread.
``faulthandler.dump_traceback_later`` runs on a C thread of its own: at the deadline it writes
every thread's Python stack to the worker's file and ends the process. xdist then reports the
case as crashed ("worker 'gw0' crashed while running ...") and starts a replacement worker.

The controller makes one directory per run and tells each worker where it is
(``workerinput[WORKER_INPUT_KEY]``); a crashed case's row quotes what the worker left there.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

WORKER_INPUT_KEY = "specgate_watchdog_dir"
TIMEOUT_HEADER = "Timeout ("  # how faulthandler's dump begins
MAX_FRAMES = 6


def dump_path(directory: Path, worker_id: str) -> Path:
    return directory / f"{worker_id}.txt"


class NativeWatchdog:
    """Worker side: ``arm`` before a phase of a check, ``cancel`` after it."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")  # kept open: faulthandler writes to its descriptor

    def arm(self, what: str, seconds: float) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{what}\n")
        self.file.flush()
        faulthandler.dump_traceback_later(seconds, exit=True, file=self.file)

    def cancel(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def _innermost_test_frames(dump: str) -> list[str]:
    """The frames of the thread that ran the check (the one inside pytest), innermost first."""
    for block in dump.split("\n\n"):
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if any("_pytest" in f for f in frames):
            return frames[:MAX_FRAMES]
    return []


def crash_message(directory: Path | None, worker_id: str, timeout_s: float,
                  grace_s: float) -> str:
    """The failure text for a case whose worker died: the watchdog's stack when it ended the
    worker, or a plain crash (a segfault, an abort) when the watchdog did not fire."""
    text = ""
    if directory is not None and dump_path(directory, worker_id).exists():
        text = dump_path(directory, worker_id).read_text()
    if TIMEOUT_HEADER not in text:
        return (f"worker {worker_id} crashed while running this check (the process died: a "
                "crash in native code, or the backend ended it); a fresh worker ran the rest")
    frames = _innermost_test_frames(text.split(TIMEOUT_HEADER, 1)[1])
    return (f"case timeout: no return within {timeout_s:g} s, nor {grace_s:g} s later (stuck "
            f"outside Python, e.g. in native code); worker {worker_id} was ended and a fresh "
            "worker ran the rest. Python stack when it was ended, innermost first: "
            + (" <- ".join(frames) if frames else "(not found)"))
