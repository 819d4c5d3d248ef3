"""report.md's "Figures" section: what the checks recorded (``record_property``), as tables.

One table per tier, its checks in node-id order: a row per check (its node id, as ``--only``
takes it), a column per figure any check of the tier recorded, "—" where a check did not record
it. A tier whose checks record more than ``MAX_COLUMNS`` different figures (the distribution
tier's samplers and controls) gets one table per test function instead, since those record
different figures; and a table that would still be that wide is turned on its side: a row per
figure, a column per check (its parametrize id). A list or dict longer than ``MAX_CELL`` characters
shows its first values and how many there are. Figures with a section of their
own (``SHOWN_ELSEWHERE``) are left out, and so are those of checks that did not run: a check
may record a figure before it skips (the kernel tier names the implementation, then finds it
cannot run here), and a figure beside a skipped check would read as measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conformance.report.coverage import RAN
from conformance.report.results import CheckRow, JsonValue

# figures with a section of their own (histograms and per-position rates: Acceptance; near-ties:
# What was certified), left out of the tables
SHOWN_ELSEWHERE = frozenset({"accept_hist", "golden_accept_hist", "near_ties",
                             "per_position_acceptance", "golden_per_position_acceptance"})
MAX_COLUMNS = 8
MAX_CELL = 40


@dataclass
class Recorded:
    nodeid: str
    figures: dict[str, JsonValue]

    @property
    def function(self) -> str:
        return self.nodeid.partition("[")[0]

    @property
    def param(self) -> str:
        return self.nodeid.partition("[")[2].rstrip("]") or self.nodeid


def _text(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _items(value: list[object] | tuple[object, ...] | dict[object, object]) -> list[str]:
    if isinstance(value, dict):
        return [f"{_text(k)}: {_text(v)}" for k, v in value.items()]
    return [_text(v) for v in value]


def cell(value: object) -> str:
    """One value for a markdown table cell, on one line with its pipes escaped. A list or dict
    longer than MAX_CELL characters shows the items that fit and how many there are."""
    if not isinstance(value, (list, tuple, dict)):
        return _text(value)
    items = _items(value)
    if len(", ".join(items)) <= MAX_CELL:
        return ", ".join(items)
    more = f"… ({len(items)} values)"
    shown: list[str] = []
    for item in items:
        if len(", ".join([*shown, item, more])) > MAX_CELL:
            break
        shown.append(item)
    return ", ".join([*shown, more])


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(head), "|" + "---|" * len(head), *(_row(r) for r in rows), ""]


def _keys(checks: list[Recorded]) -> list[str]:
    return sorted({k for c in checks for k in c.figures})


def _by_check(checks: list[Recorded]) -> list[str]:
    keys = _keys(checks)
    return _table(["check", *keys],
                  [[f"`{c.nodeid}`", *(cell(c.figures[k]) if k in c.figures else "—"
                                        for k in keys)] for c in checks])


def _by_figure(checks: list[Recorded]) -> list[str]:
    return _table(["figure", *(f"`{c.param}`" for c in checks)],
                  [[k, *(cell(c.figures[k]) if k in c.figures else "—" for c in checks)]
                   for k in _keys(checks)])


def _function_table(checks: list[Recorded]) -> list[str]:
    wide = len(_keys(checks)) > MAX_COLUMNS
    return [f"`{checks[0].function}`:", "",
            *(_by_figure(checks) if wide else _by_check(checks))]


def tier_tables(checks: list[Recorded]) -> list[str]:
    """The markdown of one tier's figures (see the module docstring for the layout)."""
    if len(_keys(checks)) <= MAX_COLUMNS:
        return _by_check(checks)
    functions: dict[str, list[Recorded]] = {}
    for c in checks:
        functions.setdefault(c.function, []).append(c)
    return [line for group in functions.values() for line in _function_table(group)]


def figures_lines(checks: Sequence[CheckRow]) -> list[str]:
    """The "Figures" section of report.md (nothing when no check that ran recorded a
    figure)."""
    tiers: dict[str, list[Recorded]] = {}
    for check in sorted(checks, key=lambda c: c.nodeid):
        if check.outcome not in RAN:
            continue
        shown = {k: v for k, v in check.figures.items() if k not in SHOWN_ELSEWHERE}
        if shown:
            tiers.setdefault(check.tier, []).append(Recorded(check.nodeid, shown))
    if not tiers:
        return []
    out = ["## Figures", "", "What the checks recorded, per tier (\"—\": not recorded by that "
           "check).", ""]
    for tier, recorded in sorted(tiers.items()):
        out += [f"### {tier}", "", *tier_tables(recorded)]
    return out
