"""Tables on stdout: the certificate's tiers, the summary of every spec, the mutants."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from conformance.report.certificate import Certificate

# the order the every-spec table names tier statuses in: what needs looking at first
_STATUS_ORDER = ("failed", "incomplete", "known failure", "not claimed", "skipped")


def stdout_console() -> Console:
    """Rich console on stdout, 120 columns wide when not a terminal."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 120  # a log or a pipe: wide enough that tables do not wrap
    return console


def table(title: str, columns: list[str], rows: list[list[str]], right: tuple[str, ...] = ()
          ) -> Table:
    """A rich table; ``right``: the columns of figures."""
    from rich.table import Table

    made = Table(title=title)
    for column in columns:
        made.add_column(column, justify="right" if column in right else "left",
                        overflow="fold")
    for row in rows:
        made.add_row(*row)
    return made


def print_table(title: str, columns: list[str], rows: list[list[str]],
                right: tuple[str, ...] = ()) -> None:
    """A rich table on stdout; ``right``: the columns of figures."""
    stdout_console().print(table(title, columns, rows, right))


def tiers_cell(cert: Certificate) -> str:
    """A certificate's tiers in one cell: how many passed, then each other status with its
    tiers (``9 passed; not claimed: graph, kernel``)."""
    by_status: dict[str, list[str]] = {}
    for t in cert.tiers:
        by_status.setdefault(t.status, []).append(t.tier)
    others = [f"{s}: {', '.join(by_status[s])}" for s in
              sorted(set(by_status) - {"passed"},
                     key=lambda s: (_STATUS_ORDER.index(s) if s in _STATUS_ORDER
                                    else len(_STATUS_ORDER), s))]
    return "; ".join([f"{len(by_status.get('passed', []))} passed", *others])


def spec_table(title: str, certs: list[Certificate]) -> Table:
    """The every-spec table of a multi-spec run: a row per spec, its tiers in one cell, so that
    it fits 80 columns without breaking a word (summary.md has a column per tier)."""
    from conformance.report.certificate import headline

    rows = [[c.spec, headline(c), f"{c.coverage.ran}/{c.coverage.total}",
             c.coverage.met or "none", tiers_cell(c)] for c in certs]
    return table(title, ["spec", "result", "ran", "coverage", "tiers"], rows, right=("ran",))


def print_summary(title: str, certs: list[Certificate], summary: Path) -> None:
    """The every-spec table, then where summary.md is (``summary``: as the user will find
    it)."""
    out = stdout_console()
    out.print(spec_table(title, certs))
    out.print(f"summary: {summary}", markup=False, soft_wrap=True)


def print_certificate(cert: Certificate, where: Path) -> None:
    """The tier table, then the checks that did not run, each failure with the command that
    replays it, and what the known-failures file did; ``where``: the certificate directory."""
    from conformance.report.certificate import full_headline, headline, rerun_of, tier_share
    from conformance.report.failures import console_lines
    from conformance.report.verdict import OUTCOMES

    counts = OUTCOMES
    rows = []
    for t in cert.tiers:
        style = {"failed": "bold red", "passed": "green"}.get(t.status, "yellow")
        rows.append([t.tier, tier_share(t), *(str(t.counts.get(o, 0)) for o in counts),
                     f"{t.seconds:.1f}", f"[{style}]{t.status}[/]"])
    print_table(f"specgate certificate for {cert.backend.name} {cert.backend.version}, "
                 f"spec {cert.spec}: {headline(cert)}",
                 ["tier", "ran", *counts, "seconds", "status"], rows,
                 right=("ran", *counts, "seconds"))
    out = stdout_console()
    out.print(f"{cert.spec}: {full_headline(cert)}", markup=False, soft_wrap=True)
    if cert.unmet:
        out.print(f"  FAILED --require {cert.required}: {cert.unmet}", markup=False)
    for t in cert.tiers:
        for why, n in t.not_run.items():
            out.print(f"  {t.tier}: {n} check(s) {why}", markup=False)
    if cert.self_checks:
        outcomes = Counter(c.outcome for c in cert.self_checks)
        out.print("  suite self-checks (not the backend's; not counted above): "
                  + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())), markup=False)
        for c in cert.self_checks:
            if c.outcome == "failed":
                out.print(f"    FAILED {c.check}: {c.message}", markup=False)
    for line in console_lines(cert.failures, rerun_of(cert), cert.known_failures, where):
        out.print(line, markup=False, soft_wrap=True)  # commands stay whole for copy-paste
    out.print(f"reports: {where / 'report.md'}, {where / 'report.json'}, "
              f"{where / 'junit.xml'}", markup=False)
