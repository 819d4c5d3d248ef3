"""``certify --known-failures FILE``: failures a gate carries for a while, each with a reason.

The file is TOML (stdlib ``tomllib``; ``tomli`` on Python 3.10), one table per check id::

    [known-failures."test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-1]"]
    reason = "tracked in #123"
    expires = 2026-12-31    # optional: from the next day on it excuses nothing
    spec = "eagle"          # optional: only in this spec's certificate (or a list of specs:
                            # one id can be listed once, and may fail under several)
    repro = "repros/x.json" # optional: a repro file replaying the failure (from this file's
                            # directory); the certificate shows the command that replays it

or the short form ``"<check id>" = "<reason>"`` inside ``[known-failures]``. A spec must be one
the suite knows, a repro file must exist, and certify checks every id's ``file::function``
against the suite's checks (``conformance.run.suite_checks``): a misspelt entry would excuse
nothing, silently, so it is refused.

It is applied to the results after the suite ran (``apply_known``), never inside pytest: a
listed check that failed becomes a "known failure" (not passed, not failing the gate); a listed
check that passed is "stale" (a warning, or a failure of the gate under ``--strict-known``); an
expired entry excuses nothing, and is listed as expired with its check's outcome; a listed id
that matches no check in a certificate is listed there as unknown (and warned about on stderr
when it matches no check in the whole run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

from conformance.plan.specs import SPECS
from conformance.report.results import CheckRow, KnownItem, KnownReport, Replay, RunResults
from conformance.report.verdict import KNOWN_FAILURE
from conformance.run.suite_checks import suite_checks, unknown_check
from specwire.untrusted import MiB, load_toml

SECTION = "known-failures"
FIELDS = ("reason", "expires", "spec", "repro")
MAX_FILE_BYTES = 16 * MiB


@dataclass(frozen=True)
class KnownFailure:
    check: str
    reason: str
    expires: date | None = None
    spec: str | tuple[str, ...] | None = None  # None: every spec
    repro: str | None = None  # a repro file replaying the failure, as a path from the cwd

    @property
    def specs(self) -> tuple[str, ...]:
        """The specs the entry names (none: every spec)."""
        return (self.spec,) if isinstance(self.spec, str) else self.spec or ()

    def covers(self, spec: str) -> bool:
        """Whether the entry applies in ``spec``'s certificate."""
        return self.spec is None or spec in self.specs


def _entry(check: str, value: object, where: str, base: Path) -> KnownFailure:
    """One entry; ``base``: the file's directory, which a repro path is relative to."""
    if isinstance(value, str):
        value = {"reason": value}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {check!r:.200}: expected a reason or a table, got "
                         f"{value!r:.80}")
    extra = set(value) - set(FIELDS)
    if extra:
        raise ValueError(f"{where}: {check!r}: unknown field(s) {', '.join(sorted(extra))} "
                         f"(known: {', '.join(FIELDS)})")
    reason, expires, spec = value.get("reason"), value.get("expires"), value.get("spec")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"{where}: {check!r}: needs a reason (a non-empty string)")
    if expires is not None and (not isinstance(expires, date) or hasattr(expires, "hour")):
        raise ValueError(f"{where}: {check!r}: expires must be a TOML date (2026-12-31), "
                         f"got {expires!r}")
    if isinstance(spec, list) and spec and all(isinstance(s, str) and s for s in spec):
        spec = tuple(spec)
    elif spec is not None and not isinstance(spec, str):
        raise ValueError(f"{where}: {check!r}: spec must be a string or a non-empty list of "
                         f"strings, got {spec!r:.80}")
    if "::" not in check:
        raise ValueError(f"{where}: {check!r} is not a check id (file.py::name[...])")
    entry = KnownFailure(check, reason.strip(), expires, spec,
                         _repro(value.get("repro"), base, f"{where}: {check!r}"))
    unknown = [s for s in entry.specs if s not in SPECS]
    if unknown:
        raise ValueError(f"{where}: {check!r}: unknown spec(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(SPECS)})")
    return entry


def _repro(value: object, base: Path, entry: str) -> str | None:
    """The entry's repro file as a path from the cwd (``base``: the file's directory)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{entry}: repro must be a path (a non-empty string), got "
                         f"{value!r:.80}")
    path = base / value.strip()
    if not path.is_file():
        raise ValueError(f"{entry}: repro file {path} does not exist")
    return str(path)


def load_known(path: Path, suites: Path | None = None) -> list[KnownFailure]:
    """The entries of ``path``; ValueError (one line naming file, entry and problem) if it
    cannot be read, does not parse, or holds a bad field; with ``suites`` (the suite's
    directory: certify always gives it), also if an id names no check of the suite."""
    where = f"--known-failures {path}"
    data = load_toml(path, where, MAX_FILE_BYTES)
    extra = set(data) - {SECTION}
    if extra or not isinstance(data.get(SECTION, {}), dict):
        raise ValueError(f"{where}: expected only a [{SECTION}] table, found "
                         f"{', '.join(sorted(extra)) or type(data[SECTION]).__name__}")
    entries = [_entry(check, value, where, path.parent)
               for check, value in data.get(SECTION, {}).items()]
    if suites is not None:
        checks = suite_checks(suites)
        for entry in entries:
            why = unknown_check(entry.check, checks)
            if why:
                raise ValueError(f"{where}: {entry.check!r}: no such check: {why}")
    return entries


def _item(entry: KnownFailure, outcome: str | None) -> KnownItem:
    return KnownItem(entry.check, entry.reason, outcome,
                     entry.expires.isoformat() if entry.expires else None)


def _kind(entry: KnownFailure, outcome: str, today: date) -> str:
    """Which list of the report an entry whose check ended with ``outcome`` goes to."""
    if entry.expires is not None and entry.expires < today:
        return "expired"
    return {"failed": "known", "passed": "stale"}.get(outcome, "not_run")


def apply_known(results: RunResults, entries: list[KnownFailure], file: str, strict: bool,
                today: date) -> RunResults:
    """``results`` with listed failures turned into known failures, and a ``known_failures``
    record of what every entry for this spec did: a known failure with its message and what
    replays it (the repro file the run wrote, under the certificate directory, and whether it
    reproduced, as a failure's; the one the entry names, ``listed_repro``)."""
    mine = {e.check: e for e in entries if e.covers(results.spec)}
    kinds: dict[str, list[KnownItem]] = {k: [] for k in ("known", "stale", "expired", "not_run")}
    checks: list[CheckRow] = []
    for row in results.checks:
        entry = mine.pop(row.nodeid, None)
        if entry is not None:
            kind, item = _kind(entry, row.outcome, today), _item(entry, row.outcome)
            if kind == "known":
                row = replace(row, outcome=KNOWN_FAILURE, known_reason=entry.reason)
                item = replace(item, message=row.message, replay=Replay.of(row),
                               listed_repro=entry.repro)
            kinds[kind].append(item)
        checks.append(row)
    report = KnownReport(file, strict, known=tuple(kinds["known"]), stale=tuple(kinds["stale"]),
                         expired=tuple(kinds["expired"]), not_run=tuple(kinds["not_run"]),
                         unknown=tuple(_item(e, None) for e in mine.values()))
    return replace(results, checks=tuple(checks), known_failures=report)
