"""A suite run's results, typed: one ``CheckRow`` per check and the ``RunResults`` of one spec's
run, as the plugin's collector makes them and ``specgate certify`` finishes them (specgate
version, shard, selection, known failures) before they become a certificate.

These are values: the collector builds them, the certify flow, known failures and ``report
merge`` derive new ones (``dataclasses.replace``), and the certificate is built from them. Their
JSON form (the results file, and the rows and known-failures record of report.json) is read and
written in one place, ``conformance.report.results_json``; a field whose metadata is ``OMIT``
is left out of the JSON when it holds its default, and one marked ``FLAT`` is written as its
own fields in its parent's object, so the files keep the shape tools already read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from conformance.contract import Capabilities

# JSON values: a check's figures are whatever it recorded (record_property), within JSON
JsonValue: TypeAlias = "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None"
Scalar: TypeAlias = "str | int | float | bool | None"

OMIT = {"omit": True}  # left out of the JSON when it holds its default
FLAT = {"flat": True}  # its fields written into its parent's object (None: nothing)
DEFAULT_MODEL = "tiny-code"  # certify's --model default
KNOWN_KINDS = ("known", "stale", "expired", "not_run", "unknown")  # KnownReport's lists


@dataclass(frozen=True)
class BackendIdentity:
    name: str
    version: str
    resolved_from: str  # what the run named it by (entry point, module:factory, mutant:<name>)
    contract_version: int | None = None  # the adapter contract it declares (None: not recorded)


@dataclass(frozen=True)
class ConfigRecord:
    """A configuration the run covered: its id and every parameter (``SpecConfig``'s fields,
    ``algorithm: none`` for plain decoding)."""

    id: str
    parameters: dict[str, Scalar] = field(default_factory=dict, metadata=FLAT)


@dataclass(frozen=True)
class CheckRow:
    """One suite check as it ended: outcome, time, message (why it failed or did not run), the
    figures it recorded, and where a failure left a repro file."""

    nodeid: str
    tier: str
    outcome: str  # one of ``conformance.report.verdict.OUTCOMES``
    duration: float = 0.0
    requires: str = ""  # the capabilities it needs, comma-separated
    message: str = ""
    figures: dict[str, JsonValue] = field(default_factory=dict)
    self_check: bool = field(default=False, metadata=OMIT)  # the suite checking itself
    threads: int | None = field(default=None, metadata=OMIT)  # torch threads it ran with
    repro: str | None = field(default=None, metadata=OMIT)  # under the certificate directory
    repro_reproduces: bool | None = field(default=None, metadata=OMIT)  # None: not replayed
    repro_not_replayed: str | None = field(default=None, metadata=OMIT)  # why not
    progress: tuple[str, ...] = field(default=(), metadata=OMIT)  # the backend's progress lines
    known_reason: str | None = field(default=None, metadata=OMIT)  # a listed known failure's


@dataclass(frozen=True)
class Replay:
    """What replays a failure: its repro file (under the certificate directory) and whether
    replaying it reproduced the failure ("yes", "no", "not replayed", and why not)."""

    repro: str
    repro_reproduces: str
    repro_not_replayed: str | None = field(default=None, metadata=OMIT)

    @staticmethod
    def of(row: CheckRow) -> Replay | None:
        """The replay of a failed check's row; None where the check left no repro file."""
        if not row.repro:
            return None
        said = ("not replayed" if row.repro_reproduces is None
                else "yes" if row.repro_reproduces else "no")
        return Replay(row.repro, said, row.repro_not_replayed or None)


@dataclass(frozen=True)
class KnownItem:
    """What one known-failures entry did in a certificate: its check, reason, expiry and the
    check's outcome (None: no such check here); a known failure's message and replays too."""

    check: str
    reason: str
    outcome: str | None
    expires: str | None  # ISO date
    message: str | None = field(default=None, metadata=OMIT)
    replay: Replay | None = field(default=None, metadata=FLAT)
    listed_repro: str | None = field(default=None, metadata=OMIT)  # the entry's own repro file


@dataclass(frozen=True)
class KnownReport:
    """What the known-failures file did in one certificate (``certify --known-failures``)."""

    file: str
    strict: bool  # --strict-known: a stale entry fails the gate
    known: tuple[KnownItem, ...] = ()    # failed, excused
    stale: tuple[KnownItem, ...] = ()    # passed now
    expired: tuple[KnownItem, ...] = ()  # excuses nothing any more
    not_run: tuple[KnownItem, ...] = ()  # skipped or not claimed
    unknown: tuple[KnownItem, ...] = ()  # no such check here

    def kind(self, name: str) -> tuple[KnownItem, ...]:
        """The items of one list by its report.json name (``known``, ``stale``, ...)."""
        lists = {"known": self.known, "stale": self.stale, "expired": self.expired,
                 "not_run": self.not_run, "unknown": self.unknown}
        return lists[name]


@dataclass(frozen=True)
class RunResults:
    """One spec's run: what ran it, what it covered, where, and a row per check; certify adds
    the specgate version, the shard, the selection, ``--require`` and the known failures."""

    backend: BackendIdentity
    capabilities: Capabilities
    spec: str
    profile: str
    checks: tuple[CheckRow, ...]
    # capability -> why the backend does not claim it (Backend.unclaimed_reasons, optional)
    unclaimed_reasons: dict[str, str] = field(default_factory=dict)
    configurations: tuple[ConfigRecord, ...] = ()
    precision: str = "float32"  # Capabilities.precision, where the backend's adapter has it
    case_timeout: float | None = None  # seconds per phase of a check; 0: no limit
    threads: tuple[int, ...] = ()  # torch threads the checks ran with
    graphs: str | None = None  # the graph executor the run asked for (None: eager)
    device: str = "cpu"
    model: str = DEFAULT_MODEL
    draft_model: str | None = None
    environment: dict[str, Scalar] = field(default_factory=dict)  # conformance.report.environment
    vacuous: str | None = None  # why the run certifies nothing (None: it certifies something)
    collected: dict[str, int] = field(default_factory=dict)  # tier -> checks it was to run
    interrupted: bool = False
    specgate_version: str = ""
    shard: str | None = None  # "I/N"; "merged from N shards" after a merge
    selection: str | None = None  # --only / -k as the run was given them
    require: str | None = None  # --require: the coverage class the run must meet
    known_failures: KnownReport | None = None
