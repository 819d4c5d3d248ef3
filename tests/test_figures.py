"""report.md's Figures section: a table per tier ("—" where a check did not record a figure),
a wide tier split per test function and a wide function turned on its side, compact long lists,
and the figures shown in a section of their own, or recorded by a check that did not run, left
out."""

from __future__ import annotations

import re

from conformance.report.figures import MAX_CELL, MAX_COLUMNS, cell, figures_lines
from conformance.report.results import CheckRow, JsonValue


def check(nodeid: str, tier: str, outcome: str = "passed", **figures: JsonValue) -> CheckRow:
    return CheckRow(nodeid, tier, outcome, figures=figures)


def test_one_table_per_tier_a_column_per_figure_and_a_dash_where_missing() -> None:
    lines = figures_lines([
        check("test_lossless.py::test_greedy[chain-s3-n4-batch-1]", "lossless", tau=2.611),
        check("test_memory.py::test_pressure[1]", "memory", retractions=1, steps=40),
        check("test_lossless.py::test_boundary[chain-s3-n4-retract]", "lossless", retractions=3,
              near_ties=["r1: index 5"]),
        check("test_golden.py::test_acceptance[chain-s3-n4]", "golden", mean_tau=2.6,
              accept_hist={"1": 3}, per_position_acceptance=[0.6, 0.5, 0.4]),
        check("test_kernel.py::test_nothing", "kernel")])
    assert lines == [
        "## Figures", "",
        "What the checks recorded, per tier (\"—\": not recorded by that check).", "",
        "### golden", "",
        "| check | mean_tau |",
        "|---|---|",
        "| `test_golden.py::test_acceptance[chain-s3-n4]` | 2.6 |", "",
        "### lossless", "",
        "| check | retractions | tau |",
        "|---|---|---|",
        "| `test_lossless.py::test_boundary[chain-s3-n4-retract]` | 3 | — |",
        "| `test_lossless.py::test_greedy[chain-s3-n4-batch-1]` | — | 2.611 |", "",
        "### memory", "",
        "| check | retractions | steps |",
        "|---|---|---|",
        "| `test_memory.py::test_pressure[1]` | 1 | 40 |", ""]


def test_no_figures_no_section() -> None:
    assert figures_lines([check("t.py::a", "lossless"),
                          check("t.py::b", "golden", accept_hist={"1": 2})]) == []


def test_only_checks_that_ran_have_figures() -> None:
    """The kernel tier records the implementation before it finds the kernels cannot run
    here: a skipped check's figure is not shown as if it had been measured."""
    lines = figures_lines([
        check("test_kernel.py::test_a", "kernel", "skipped", kernels="triton"),
        check("test_kernel.py::test_b", "kernel", "not claimed", kernels="triton"),
        check("test_kernel.py::test_c", "kernel", "failed", kernels="torch"),
        check("test_kernel.py::test_d", "kernel", "known failure", kernels="torch")])
    assert [line for line in lines if line.startswith("| `")] == [
        "| `test_kernel.py::test_c` | torch |", "| `test_kernel.py::test_d` | torch |"]
    assert figures_lines([check("test_kernel.py::test_a", "kernel", "skipped",
                                kernels="triton")]) == []


def test_a_wide_tier_gets_a_table_per_function_and_a_wide_function_lies_on_its_side() -> None:
    wide = {f"f{i}": i for i in range(MAX_COLUMNS + 1)}
    lines = figures_lines([
        check("test_d.py::test_sampled[top-p]", "distribution", **wide),
        check("test_d.py::test_sampled[top-k]", "distribution", **{**wide, "f0": "x|y"}),
        check("test_d.py::test_power[bug]", "distribution", power=1.0)])
    text = "\n".join(lines)
    assert "### distribution\n\n`test_d.py::test_power`:\n\n| check | power |\n|---|---|\n" \
           "| `test_d.py::test_power[bug]` | 1.0 |\n" in text
    assert "`test_d.py::test_sampled`:\n\n| figure | `top-k` | `top-p` |\n|---|---|---|\n" \
           "| f0 | x\\|y | 0 |\n| f1 | 1 | 1 |\n" in text  # a pipe in a value is escaped
    assert len([row for row in lines if re.match(r"\| f\d+ \|", row)]) == MAX_COLUMNS + 1


def test_a_long_list_shows_what_fits_and_how_many() -> None:
    assert cell([0.6839, 0.5321, 0.4394]) == "0.6839, 0.5321, 0.4394"
    assert cell({"1": 3, "4": 4}) == "1: 3, 4: 4"
    long = cell([round(0.1 * i, 1) for i in range(40)])
    assert long.endswith("… (40 values)") and long.startswith("0.0, 0.1, 0.2")
    assert len(long) <= MAX_CELL
    assert cell("a setting: temperature 1.3, top_k 6, top_p 0.75, and more words") == (
        "a setting: temperature 1.3, top_k 6, top_p 0.75, and more words")  # text stays whole
