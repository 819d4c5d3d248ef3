"""The verdict rules: what a row counts as, a tier's status, when a run is vacuous, and when it
fails.

A *self-check* exercises no part of the backend under test: it proves the suite's own power
(a negative control run on a bug-zoo mutant, a power computation from the oracle alone). Its
pass is the suite's, so it is reported in its own section and never counted among the
backend's passes; if one fails, the suite cannot vouch for the checks that depend on it, and
the run fails. A run in which no check of the backend passed or failed is vacuous, whatever
the self-checks did.

A tier's status is, in order: "failed" if any check failed; "passed" if one passed; "known
failure" if the checks that ran are all known failures (``--known-failures``); "not claimed"
if every check was gated off by an undeclared capability; else "skipped". Nothing counts as
passed unless at least one check in it passed. A run fails when a tier failed, it is vacuous
(with known failures, a run in which no check of the backend passed is vacuous too), a stale
known-failures entry meets ``--strict-known``, a self-check failed, ``--require`` is not met, or
no tier ran at all; a run stopped by Ctrl-C is "incomplete", whatever finished.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from conformance.report.results import CheckRow, RunResults

KNOWN_FAILURE = "known failure"  # the outcome of a failed check a known-failures file lists
NOT_CLAIMED = "not claimed"  # gated off: the backend does not declare a capability it needs
OUTCOMES = ("passed", "failed", KNOWN_FAILURE, NOT_CLAIMED, "skipped")
INCOMPLETE = "incomplete"  # a tier (or run) an interrupt cut short


def is_self_check(row: CheckRow) -> bool:
    return row.self_check


def backend_rows(rows: Iterable[CheckRow]) -> list[CheckRow]:
    """The rows that exercised (or would have exercised) the backend under test."""
    return [r for r in rows if not is_self_check(r)]


def vacuous_reason(rows: Sequence[CheckRow]) -> str | None:
    """Why a finished run certifies nothing (None: it certifies something)."""
    checks = backend_rows(rows)
    if not checks:
        return "zero checks collected" if not rows else (
            f"all {len(rows)} checks are the suite's self-checks")
    if not {r.outcome for r in checks} & {"passed", "failed"}:
        return f"all {len(checks)} checks were skipped or not claimed"
    return None


def tier_status(outcomes: Iterable[str]) -> str:
    """The status of a tier (or of a tier's checks needing one capability) from its checks'
    outcomes."""
    counts = Counter(outcomes)
    for status in ("failed", "passed", KNOWN_FAILURE, NOT_CLAIMED):
        if counts[status]:
            return status
    return "skipped"


@dataclass(frozen=True)
class Verdict:
    status: str  # "passed" | "failed" | "incomplete"
    vacuous: str | None


def run_verdict(results: RunResults, tier_statuses: Sequence[str], unmet: str | None
                ) -> Verdict:
    """The run's status and why it is vacuous, from its tiers' statuses and ``unmet`` (why
    ``--require`` is not met, or None)."""
    checks = backend_rows(results.checks)
    known = results.known_failures
    vacuous = results.vacuous
    if not vacuous and checks and known and not any(c.outcome == "passed" for c in checks):
        vacuous = "no check passed (every failure is a known failure)"
    if results.interrupted:
        return Verdict(INCOMPLETE, vacuous)
    failed = ("failed" in tier_statuses or bool(vacuous) or bool(unmet) or not tier_statuses
              or bool(known and known.strict and known.stale)
              or any(r.outcome == "failed" for r in results.checks if is_self_check(r)))
    return Verdict("failed" if failed else "passed",
                   vacuous or (None if tier_statuses else "zero checks collected"))
