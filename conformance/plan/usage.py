"""How a command reports a bad argument or an interruption: one line, and its exit code."""

from __future__ import annotations

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


class UsageError(Exception):
    """A bad argument or configuration: printed as one line, exit code 2."""


class Interrupted(Exception):
    """The user pressed Ctrl-C: printed as one line (what was kept), exit code 130."""
