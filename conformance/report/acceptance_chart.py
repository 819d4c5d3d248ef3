"""acceptance.png: per configuration, the accept-length histogram of the backend beside the
golden trace's, and beside it the per-position acceptance rate.

One panel per configuration, top to bottom, titled with the configuration's id. Left, the
accept-length histogram: per accept length (tokens per verify step, bonus included) the share
of verify steps, backend beside golden trace, each series normalised to its own total so runs
of different sizes compare. Right, the per-position acceptance rate derived from the same
histograms: for draft position i = 1 .. (longest accept length - 1),

    rate(i) = (verify steps with accept length n >= i + 1) / (all verify steps)

that is, the share of verify steps that accepted at least i drafted tokens (a step of accept
length n accepted n - 1 drafts; the bonus token is not a draft). This equals the golden tier's
``per_position_acceptance`` on the same steps.

Drawn with matplotlib (the optional extra ``specgate[plots]``) on its Agg renderer, never a
display, under matplotlib's default style and without the PNG ``Software`` stamp, so the same
histograms give the same bytes on one installation. Without matplotlib the certificate says the
plot was skipped and why (``plots_unavailable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

BACKEND, GOLDEN = "tab:blue", "tab:orange"
DPI = 100
PANEL_SIZE = (11.0, 3.6)  # inches per configuration: histogram and rates side by side
INSTALL = "pip install 'specgate[plots]'"


@dataclass
class AcceptPanel:
    """One configuration's accept-length histograms: accept length (JSON key) -> verify steps."""

    config: str
    backend: dict[str, int]
    golden: dict[str, int]
    num_steps: int | None = None  # drafts per verify step, when the configuration states it

    @property
    def lengths(self) -> range:
        """Accept lengths 1 .. the longest seen or possible (num_steps drafts + the bonus)."""
        keys = [int(k) for k in (*self.backend, *self.golden)]
        return range(1, max([*keys, (self.num_steps or 0) + 1]) + 1)

    @property
    def positions(self) -> range:
        """Draft positions 1 .. longest accept length - 1."""
        return range(1, len(self.lengths))


def shares(hist: dict[str, int], lengths: range) -> list[float]:
    """Share of verify steps per accept length (0 for an empty histogram)."""
    total = sum(hist.values())
    return [hist.get(str(n), 0) / total if total else 0.0 for n in lengths]


def per_position_rates(hist: dict[str, int], positions: range) -> list[float]:
    """Per draft position i: the share of verify steps whose accept length n (bonus included)
    is at least i + 1, i.e. that accepted at least i drafted tokens."""
    total = sum(hist.values())
    return [sum(c for n, c in hist.items() if int(n) >= i + 1) / total if total else 0.0
            for i in positions]


def plots_unavailable() -> str | None:
    """Why acceptance.png cannot be drawn here (one line), or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        return f"matplotlib is not available ({err}); {INSTALL} draws it"
    return None


def _steps(hist: dict[str, int]) -> str:
    return f"{sum(hist.values())} verify steps"


def _histogram(ax: Axes, panel: AcceptPanel) -> None:
    lengths = list(panel.lengths)
    width = 0.4
    ax.bar([n - width / 2 for n in lengths], shares(panel.backend, panel.lengths), width,
           color=BACKEND, label=f"backend ({_steps(panel.backend)})")
    ax.bar([n + width / 2 for n in lengths], shares(panel.golden, panel.lengths), width,
           color=GOLDEN, label=f"golden trace ({_steps(panel.golden)})")
    ax.set_title("accept-length histogram")
    ax.set_xlabel("accept length (tokens per verify step, bonus included)")
    ax.set_ylabel("share of verify steps")
    ax.set_xticks(lengths)


def _rates(ax: Axes, panel: AcceptPanel) -> None:
    positions = list(panel.positions)
    ax.plot(positions, per_position_rates(panel.backend, panel.positions), "o-", color=BACKEND)
    ax.plot(positions, per_position_rates(panel.golden, panel.positions), "s--", color=GOLDEN)
    ax.set_title("per-position acceptance")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of verify steps\naccepting ≥ i drafts")
    ax.set_xticks(positions)
    ax.set_ylim(0.0, 1.05)
    ax.grid(axis="y", alpha=0.3)


def _panel(sub: SubFigure, panel: AcceptPanel) -> None:
    from matplotlib.legend_handler import HandlerTuple

    sub.suptitle(panel.config, fontweight="bold")
    hist_ax, rate_ax = sub.subplots(1, 2)
    _histogram(hist_ax, panel)
    _rates(rate_ax, panel)
    # one legend for both charts, below them: each series' bar beside its line
    bars, labels = hist_ax.get_legend_handles_labels()
    sub.legend([(bar, line) for bar, line in zip(bars, rate_ax.get_lines(), strict=True)],
               labels, loc="outside lower center", ncols=2, frameon=False,
               handler_map={tuple: HandlerTuple(ndivide=None)})


def draw_acceptance(panels: list[AcceptPanel]) -> Figure:
    """The chart as a matplotlib figure (no pyplot, so no global state and no display)."""
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("an acceptance chart needs at least one configuration")
    width, height = PANEL_SIZE
    fig = Figure(figsize=(width, height * len(panels)), dpi=DPI, layout="constrained")
    for sub, panel in zip(fig.subfigures(len(panels), 1, squeeze=False)[:, 0], panels,
                          strict=True):
        _panel(sub, panel)
    return fig


def save_acceptance(panels: list[AcceptPanel], path: Path) -> None:
    """Write acceptance.png under matplotlib's default style, whatever the user's matplotlibrc."""
    import matplotlib.style

    with matplotlib.style.context("default"):
        draw_acceptance(panels).savefig(path, format="png", dpi=DPI,
                                        metadata={"Software": None})
