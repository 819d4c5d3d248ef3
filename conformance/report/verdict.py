"""What a run's rows may be counted as: the backend's checks, or the suite checking itself.

A *self-check* exercises no part of the backend under test: it proves the suite's own power
(a negative control run on a bug-zoo mutant, a power computation from the oracle alone). Its
pass is the suite's, so it is reported in its own section and never counted among the
backend's passes; if one fails, the suite cannot vouch for the checks that depend on it, and
the run fails. A run in which no check of the backend passed or failed is vacuous, whatever
the self-checks did.
"""

from __future__ import annotations

from collections.abc import Iterable

SELF_CHECK_MARK = "specgate_self_check"
KNOWN_FAILURE = "known failure"  # the outcome of a failed check a known-failures file lists


def is_self_check(row: dict[str, object]) -> bool:
    return bool(row.get("self_check"))


def backend_rows(rows: Iterable[dict[str, object]]) -> list[dict[str, object]]:
    """The rows that exercised (or would have exercised) the backend under test."""
    return [r for r in rows if not is_self_check(r)]


def vacuous_reason(rows: list[dict[str, object]]) -> str | None:
    """Why a finished run certifies nothing (None: it certifies something)."""
    checks = backend_rows(rows)
    if not checks:
        return "zero checks collected" if not rows else (
            f"all {len(rows)} checks are the suite's self-checks")
    if not {r["outcome"] for r in checks} & {"passed", "failed"}:
        return f"all {len(checks)} checks were skipped or not claimed"
    return None
