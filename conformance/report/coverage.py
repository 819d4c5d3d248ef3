"""How much a certificate tested: checks run against checks collected, what was not claimed,
and the largest coverage class met (docs/adapter.md, "Coverage classes").

A PASSED verdict alone says nothing of scope: a backend claiming plain decoding alone passes
a fifth of the checks the reference engine runs. The headline therefore says how many checks
ran and why the rest did not, and a CI gate can require a class (``certify --require``): a
class is met when no check it needs was "not claimed". A check needs a class when every
capability flag it requires is in the class (the spec's own requirements, its algorithm and
the tree or overlap scheduling it needs, are the certificate's, not a class's). Checks that
were not applicable (skipped with a reason) do not count against a class: they say why the
check could not apply, not that the backend declined it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from conformance.contract import Capabilities
from conformance.report.results import CheckRow
from conformance.report.verdict import KNOWN_FAILURE, NOT_CLAIMED

RAN = ("passed", "failed", KNOWN_FAILURE)
SPEC_LEVEL = ("tree", "overlap")  # with algorithm:<name>: what the spec asks, not a class


@dataclass(frozen=True)
class CoverageClass:
    name: str
    flags: frozenset[str] | None  # None: every check
    meaning: str


_SERVING = frozenset({"stepwise", "abort", "sampling", "seeded_sampling", "memory_view"})
CLASSES = (
    CoverageClass("outputs", frozenset(),
                  "greedy outputs and finishes against the reference, nothing else claimed"),
    CoverageClass("serving", _SERVING,
                  "outputs, plus step-by-step serving: abort, sampling, seeds, the KV memory view"),
    CoverageClass("speculation", _SERVING | {"acceptance_stats", "reference_draft"},
                  "serving, plus the drafts themselves: acceptance per verify step against the "
                  "golden traces"),
    CoverageClass("full", None, "every check of the spec ran or was not applicable"),
)
CLASS_NAMES = tuple(c.name for c in CLASSES)


@dataclass
class Coverage:
    total: int
    ran: int
    not_claimed: int
    not_applicable: int
    # capability -> checks not claimed for want of it, most first
    missing: dict[str, int] = field(default_factory=dict)
    met: str | None = None  # the largest class met (None: not even "outputs")
    # class -> why it is not met ("... not claimed", or none of its checks ran); met: absent
    gaps: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``74 of 82 checks ran; 8 not applicable`` or ``15 of 75 checks ran; 60 not claimed
        (sessions, memory_view, ...)``."""
        parts = [f"{self.ran} of {self.total} checks ran"]
        if self.not_claimed:
            names = list(self.missing)
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            parts.append(f"{self.not_claimed} not claimed ({shown})")
        if self.not_applicable:
            parts.append(f"{self.not_applicable} not applicable")
        return "; ".join(parts)

    def unmet(self, name: str) -> str | None:
        """Why the class ``name`` is not met, in one line; None when it is."""
        if name not in self.gaps:
            return None
        return f"coverage class {name!r} not met: {self.gaps[name]}"


def claims(caps: Capabilities, name: str) -> bool:
    """Whether ``caps`` claims the capability ``name`` (one the contract does not know: no)."""
    try:
        return caps.claims(name)
    except ValueError:
        return False


def _flags(row: CheckRow) -> set[str]:
    return {c for c in row.requires.split(",")
            if c and not c.startswith("algorithm:") and c not in SPEC_LEVEL}


def _wanting(row: CheckRow, claimed: Capabilities) -> list[str]:
    """The capabilities a not-claimed check lacked: its required ones the backend does not
    claim, else (claimed, but not under this configuration: ``unclaimed_under``) the flag its
    message names first."""
    lacking = [c for c in row.requires.split(",") if c and not claims(claimed, c)]
    if lacking:
        return lacking
    # the row keeps pytest's skip reason as pytest words it: "Skipped: not claimed: flag ..."
    said = row.message.removeprefix("Skipped: ").removeprefix(f"{NOT_CLAIMED}: ").split(" ", 1)[0]
    return [said.rstrip(",;")] if said else ["?"]


def coverage(checks: Sequence[CheckRow], claimed: Capabilities) -> Coverage:
    """The coverage of a certificate's backend checks (self-checks excluded by the caller);
    ``claimed``: the certificate's capabilities."""
    outcomes = Counter(r.outcome for r in checks)
    missing: Counter[str] = Counter()
    for row in checks:
        if row.outcome == NOT_CLAIMED:
            missing.update(_wanting(row, claimed))
    gaps: dict[str, str] = {}
    met = None
    for cls in CLASSES:
        needed = [r for r in checks if cls.flags is None or _flags(r) <= cls.flags]
        lacking = {name for r in needed if r.outcome == NOT_CLAIMED
                   for name in _wanting(r, claimed)}
        if lacking:
            gaps[cls.name] = f"checks it needs were not claimed ({', '.join(sorted(lacking))})"
        elif not any(r.outcome in RAN for r in needed):
            gaps[cls.name] = "none of its checks ran"
        elif not gaps:  # classes nest: met only if every smaller one is
            met = cls.name
    return Coverage(total=len(checks), ran=sum(outcomes[o] for o in RAN),
                    not_claimed=outcomes[NOT_CLAIMED], not_applicable=outcomes["skipped"],
                    missing=dict(missing.most_common()), met=met, gaps=gaps)
