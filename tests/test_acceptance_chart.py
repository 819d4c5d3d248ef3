"""acceptance.png: the per-position rate formula, and the figure as drawn (a panel per
configuration with its title, axis labels, legend, histogram bars and rate lines), written as a
deterministic PNG of the stated size; matplotlib is the ``plots`` extra, in the test extra."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.golden import summarize
from conformance.report.acceptance_chart import (
    DPI,
    PANEL_SIZE,
    AcceptPanel,
    draw_acceptance,
    per_position_rates,
    plots_unavailable,
    save_acceptance,
    shares,
)
from conformance.report.certified import accept_histogram

REPO = Path(__file__).resolve().parents[1]
PANELS = [AcceptPanel("chain-s3-n4", {"1": 10, "2": 30, "4": 60}, {"1": 20, "2": 20, "4": 60}, 3),
          AcceptPanel("chain-s5-n6", {"1": 5, "6": 5}, {"2": 1}, 5)]


def test_per_position_rate_counts_steps_that_accepted_at_least_i_drafts() -> None:
    # 10 verify steps: 2 took 1 token (the bonus alone), 3 took 2, 5 took 4 (3 drafts + bonus)
    hist = {"1": 2, "2": 3, "4": 5}
    panel = AcceptPanel("c", hist, {}, num_steps=3)
    assert list(panel.lengths) == [1, 2, 3, 4] and list(panel.positions) == [1, 2, 3]
    assert per_position_rates(hist, panel.positions) == [0.8, 0.5, 0.5]
    assert per_position_rates({}, panel.positions) == [0.0, 0.0, 0.0]
    # without num_steps the longest accept length seen bounds the positions
    assert list(AcceptPanel("c", hist, {"5": 1}).positions) == [1, 2, 3, 4]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6).flatmap(lambda s: st.tuples(st.just(s), st.lists(
    st.lists(st.integers(1, s + 1), max_size=8), min_size=1, max_size=5))))
def test_per_position_rate_is_the_golden_tiers(case: tuple[int, list[list[int]]]) -> None:
    """From the histogram, the same figure the golden tier records from the raw accept lengths."""
    num_steps, lens = case
    want = summarize(lens, num_steps)["per_position_acceptance"]
    panel = AcceptPanel("c", accept_histogram(lens), {}, num_steps)
    got = per_position_rates(panel.backend, panel.positions)
    assert [round(r, 4) for r in got] == (want or [0.0] * num_steps)


def test_each_configuration_is_a_titled_panel_with_labels_legend_bars_and_rates() -> None:
    fig = draw_acceptance(PANELS)
    assert [sub.get_suptitle() for sub in fig.subfigs] == ["chain-s3-n4", "chain-s5-n6"]
    for sub, panel in zip(fig.subfigs, PANELS, strict=True):
        hist_ax, rate_ax = sub.axes
        assert hist_ax.get_title() == "accept-length histogram"
        assert rate_ax.get_title() == "per-position acceptance"
        for ax in (hist_ax, rate_ax):
            assert ax.get_xlabel() and ax.get_ylabel()
        (legend,) = sub.legends
        assert [t.get_text() for t in legend.get_texts()] == [
            f"backend ({sum(panel.backend.values())} verify steps)",
            f"golden trace ({sum(panel.golden.values())} verify steps)"]
        heights = [bar.get_height() for bar in hist_ax.patches]
        assert heights == shares(panel.backend, panel.lengths) + shares(panel.golden,
                                                                       panel.lengths)
        ours, theirs = rate_ax.get_lines()
        assert list(ours.get_xdata()) == list(panel.positions)
        assert list(ours.get_ydata()) == per_position_rates(panel.backend, panel.positions)
        assert list(theirs.get_ydata()) == per_position_rates(panel.golden, panel.positions)
    first_rates = fig.subfigs[0].axes[1].get_lines()[0].get_ydata()
    assert list(first_rates) == [0.9, 0.6, 0.6]  # of 100 steps: 90 took >= 2 tokens, 60 took 4
    with pytest.raises(ValueError, match="at least one"):
        draw_acceptance([])
    # nothing but the bonus token, no golden steps, no S stated: one length, no draft position
    (lone,) = draw_acceptance([AcceptPanel("x", {"1": 3}, {})]).subfigs
    assert [bar.get_height() for bar in lone.axes[0].patches] == [1.0, 0.0]
    assert [len(line.get_xdata()) for line in lone.axes[1].get_lines()] == [0, 0]


def test_the_png_has_the_stated_size_no_stamp_and_the_same_bytes_twice(tmp_path: Path) -> None:
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    save_acceptance(PANELS, first)
    save_acceptance(PANELS, second)
    data = first.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (round(PANEL_SIZE[0] * DPI), round(PANEL_SIZE[1] * DPI) * 2)
    assert b"Software" not in data and b"matplotlib" not in data
    assert second.read_bytes() == data


def test_plots_is_an_extra_and_the_test_extra_has_it() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(req.startswith("matplotlib") for req in project["dependencies"])
    extras = project["optional-dependencies"]
    assert extras["plots"][0].startswith("matplotlib")
    assert "plots" in extras["test"][0]
    assert plots_unavailable() is None  # installed with the test extra
