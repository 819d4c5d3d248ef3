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

from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

from conformance.plan.specs import SPECS
from conformance.report.failures import replay_fields
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


@dataclass
class KnownReport:
    """What the entries did in one certificate; each item: check, reason, expires, outcome,
    and a known failure's message and replays (``_what_failed``)."""

    file: str
    strict: bool
    known: list[dict[str, object]] = field(default_factory=list)    # failed, excused
    stale: list[dict[str, object]] = field(default_factory=list)    # passed now
    expired: list[dict[str, object]] = field(default_factory=list)  # excuses nothing any more
    not_run: list[dict[str, object]] = field(default_factory=list)  # skipped or not claimed
    unknown: list[dict[str, object]] = field(default_factory=list)  # no such check here


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


def _what_failed(row: dict[str, object], entry: KnownFailure) -> dict[str, object]:
    """A known failure's message and what replays it: the repro file the run wrote (``repro``,
    under the certificate directory, and whether it reproduced, as a failure's) and the one the
    entry names (``listed_repro``)."""
    return {"message": str(row.get("message", "")), **replay_fields(row),
            **({"listed_repro": entry.repro} if entry.repro else {})}


def apply_known(results: dict[str, object], entries: list[KnownFailure], file: str,
                strict: bool, today: date) -> dict[str, object]:
    """``results`` with listed failures turned into known failures, and a ``known_failures``
    record of what every entry for this spec did."""
    spec = results["spec"]
    mine = {e.check: e for e in entries if e.covers(str(spec))}
    report = KnownReport(file, strict)
    checks = []
    for row in results["checks"]:  # type: ignore[attr-defined]
        entry = mine.pop(str(row["nodeid"]), None)
        if entry is None:
            checks.append(row)
            continue
        item = {"check": entry.check, "reason": entry.reason, "outcome": row["outcome"],
                "expires": entry.expires.isoformat() if entry.expires else None}
        if entry.expires is not None and entry.expires < today:
            report.expired.append(item)
        elif row["outcome"] == "failed":
            row = {**row, "outcome": KNOWN_FAILURE, "known_reason": entry.reason}
            report.known.append({**item, **_what_failed(row, entry)})
        elif row["outcome"] == "passed":
            report.stale.append(item)
        else:
            report.not_run.append(item)
        checks.append(row)
    report.unknown = [{"check": e.check, "reason": e.reason, "outcome": None,
                       "expires": e.expires.isoformat() if e.expires else None}
                      for e in mine.values()]
    return {**results, "checks": checks, "known_failures": asdict(report)}
