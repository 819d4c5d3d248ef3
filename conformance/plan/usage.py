"""How a run stops short: a bad argument or configuration and an interruption (each reported
as one line with its exit code), and a check that ran out of time."""

from __future__ import annotations

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


class UsageError(Exception):
    """A bad argument or configuration: printed as one line, exit code 2."""


class Interrupted(Exception):
    """The user pressed Ctrl-C: printed as one line (what was kept), exit code 130."""


class CaseTimeout(BaseException):
    """A phase of a suite check ran past its time (``conformance.run.case_timeout``). Not an
    ``Exception``: a backend's ``except Exception`` must not swallow it (pytest reports any
    BaseException from a check as that check's failure)."""
