"""The every-spec table on the console: its tiers in one cell, and never a word broken across
lines, at 80 columns (a narrow terminal) or 120 (a log); then the line naming summary.md."""

from __future__ import annotations

import io
import re
from datetime import date
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from conformance.plan.specs import SPECS
from conformance.report.certificate import Certificate, build_certificate, headline
from conformance.report.console import print_summary, spec_table, tiers_cell
from conformance.run.known_failures import KnownFailure, apply_known
from tests.test_ci_docs import SUITES
from tests.test_merge import results

TIERS = sorted(p.stem.removeprefix("test_") for p in SUITES.glob("test_*.py"))
OUTCOMES = ("passed", "failed", "not claimed", "skipped")
BOX = "\u2500-\u257f"  # box drawing


def certificate(spec: str, outcomes: list[str], known: bool) -> Certificate:
    """One check per tier with the given outcomes; ``known``: the first tier's check is a
    listed known failure (failing, or stale where it passed)."""
    checks = [(f"test_{tier}.py::check", outcome, 1.0)
              for tier, outcome in zip(TIERS, outcomes, strict=True)]
    done = results(spec, checks)
    if known:
        entry = KnownFailure(checks[0][0], "tracked")
        done = apply_known(done, [entry], "kf.toml", False, date(2026, 1, 1))
    return build_certificate(done)


def rendered(certs: list[Certificate], width: int) -> str:
    out = Console(file=io.StringIO(), width=width, force_terminal=False, highlight=False)
    out.print(spec_table("specgate certify: every spec", certs))
    return out.file.getvalue()  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(OUTCOMES), min_size=len(TIERS),
                                   max_size=len(TIERS)), st.booleans()),
                min_size=len(SPECS), max_size=len(SPECS)),
       st.sampled_from([80, 120]))
def test_no_word_is_broken(runs: list[tuple[list[str], bool]], width: int) -> None:
    """Every word the table prints is a whole word of its title, a heading or a cell."""
    certs = [certificate(spec, outcomes, known)
             for spec, (outcomes, known) in zip(SPECS, runs, strict=True)]
    text = rendered(certs, width)
    cells = ["specgate certify: every spec", "spec result ran coverage tiers",
             *(" ".join([c.spec, headline(c), f"{c.coverage.ran}/{c.coverage.total}",
                         c.coverage.met or "none", tiers_cell(c)]) for c in certs)]
    words = {w for cell in cells for w in cell.split()}
    printed = re.sub(f"[{BOX}]", " ", text).split()
    assert all(len(line) <= width for line in text.splitlines())
    assert set(printed) <= words, set(printed) - words


def test_the_tiers_cell_puts_what_needs_looking_at_first() -> None:
    cert = certificate("eagle", ["not claimed", "passed", "failed", "skipped", "not claimed",
                                 *["passed"] * (len(TIERS) - 5)], known=False)
    t = TIERS
    assert tiers_cell(cert) == (f"{len(TIERS) - 4} passed; failed: {t[2]}; not claimed: {t[0]}, "
                                f"{t[4]}; skipped: {t[3]}")


def test_the_summary_line_names_summary_md(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary("specgate certify: every spec",
                  [certificate("none", ["passed"] * len(TIERS), known=False)],
                  Path("specgate-report") / "summary.md")
    assert capsys.readouterr().out.splitlines()[-1] == "summary: specgate-report/summary.md"
