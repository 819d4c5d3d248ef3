"""What this process holds of the "aot" cache: the packages it loaded (shared by every engine on
the same weights and key), the weight blobs it read and checked, its loading markers not yet
removed and the warnings it gave; and whether the process a marker names still runs (a marker
left by a dead process means its package crashed it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Packages this process has loaded, by file: every engine on the same weights and key shares
# one (a package is called with the engine's own pool and buffers, and holds nothing else that
# a call changes), so a run that opens many engines loads each package once.
LOADED: dict[Path, LoadedPackage] = {}
# Blobs this process has read and checked, by digest: every package holding a constant shares
# its memory.
BLOBS: dict[tuple[str, str], torch.Tensor] = {}
# This process's loading markers not yet removed (their packages not yet called).
PENDING: set[Path] = set()
# (cache root, CannotBuild kind) already warned about: one warning line per process.
WARNED: set[tuple[str, str]] = set()


def unmark(marker: Path | None) -> None:
    if marker is not None:
        PENDING.discard(marker)
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)


@atexit.register
def unmark_pending() -> None:
    """A process that ends normally crashed no package, whether or not it called them all."""
    for marker in list(PENDING):
        if marker.name.endswith(f".{os.getpid()}"):  # not a forked parent's
            unmark(marker)


class LoadedPackage:
    """A package opened by this process: its runner, the constants it runs on (the runner
    keeps only their addresses) and, until its first call returns, its loading marker."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor],
                 marker: Path | None) -> None:
        self.runner, self.constants, self.marker = runner, constants, marker

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return self.runner.run(inputs)
        finally:
            if self.marker is not None:  # the first call came back: it did not crash us
                unmark(self.marker)
                self.marker = None


def proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (Linux); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), to tell it from a later process given
    the same pid; None where that cannot be read."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def alive(pid: int, host: str, started: str | None) -> bool:
    if host != socket.gethostname():
        return True  # another machine's process (a shared cache): its fate is unknown here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    fields = proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # ended (a zombie its parent has not reaped yet)
    return started is None or fields is None or len(fields) <= 19 or fields[19] == started


@dataclass(frozen=True)
class Marker:
    """A loading marker: which process, and whether it is still running."""

    path: Path
    pid: int
    alive: bool
