"""acceptance.png: the accept-length histogram of the backend beside the golden trace's.

One panel per configuration, left to right in the certificate's order. In a panel each accept
length (tokens per verify, bonus included) has two bars side by side: the backend's share of
verify steps (blue) and the golden trace's (orange), each series normalised to its own total so
runs of different sizes compare; the tallest bar of a panel is full height. The y axis has a
tick every quarter of that height, the x axis a tick and the accept length (digits) under each
pair. Figures in numbers are in report.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.report.png import RGB, Canvas

BACKEND: RGB = (31, 119, 180)
GOLDEN: RGB = (255, 127, 14)
AXIS: RGB = (60, 60, 60)
SEPARATOR: RGB = (200, 200, 200)
BAR_W, GROUP_GAP = 10, 10
LEFT, RIGHT, TOP, BOTTOM = 24, 8, 12, 26
PLOT_H = 150
TICK = 4
DIGIT_SCALE = 2
# 3x5 digit glyphs, one string of 15 cells per digit, row by row ("#" = ink)
DIGITS = ("####.##.##.####", ".#.##..#..#.###", "###..#####..###", "###..####..####",
          "#.##.####..#..#", "####..###..####", "####..####.####", "###..#..#..#..#",
          "####.#####.####", "####.####..####")


@dataclass
class AcceptPanel:
    config: str
    backend: dict[str, int]   # accept length -> verify steps
    golden: dict[str, int]

    @property
    def lengths(self) -> range:
        keys = [int(k) for k in (*self.backend, *self.golden)]
        return range(1, max(keys, default=1) + 1)


def shares(hist: dict[str, int], lengths: range) -> list[float]:
    total = sum(hist.values())
    return [hist.get(str(n), 0) / total if total else 0.0 for n in lengths]


def bar_heights(panel: AcceptPanel) -> list[tuple[int, int]]:
    """(backend, golden) bar heights in pixels per accept length."""
    ours, theirs = shares(panel.backend, panel.lengths), shares(panel.golden, panel.lengths)
    top = max([*ours, *theirs, 0.0]) or 1.0
    return [(round(a / top * PLOT_H), round(b / top * PLOT_H)) for a, b in zip(ours, theirs,
                                                                                strict=True)]


def panel_width(panel: AcceptPanel) -> int:
    return LEFT + len(panel.lengths) * (2 * BAR_W + GROUP_GAP) + GROUP_GAP + RIGHT


def _digits(canvas: Canvas, text: str, centre_x: int, y: int) -> None:
    cell = DIGIT_SCALE
    x = centre_x - (len(text) * 4 * cell - cell) // 2
    for ch in text:
        for i, ink in enumerate(DIGITS[int(ch)]):
            if ink == "#":
                cx, cy = x + (i % 3) * cell, y + (i // 3) * cell
                canvas.fill(cx, cy, cx + cell, cy + cell, AXIS)
        x += 4 * cell


def _draw_panel(canvas: Canvas, panel: AcceptPanel, x0: int) -> None:
    base = TOP + PLOT_H  # the x axis' row; bars stand on it
    axis_x = x0 + LEFT - 2
    canvas.fill(axis_x, TOP, axis_x + 1, base + 1, AXIS)
    canvas.fill(axis_x, base, x0 + panel_width(panel) - RIGHT, base + 1, AXIS)
    for quarter in range(5):
        y = base - round(quarter * PLOT_H / 4)
        canvas.fill(axis_x - TICK, y, axis_x, y + 1, AXIS)
    for i, (ours, theirs) in enumerate(bar_heights(panel)):
        left = x0 + LEFT + GROUP_GAP + i * (2 * BAR_W + GROUP_GAP)
        canvas.fill(left, base - ours, left + BAR_W, base, BACKEND)
        canvas.fill(left + BAR_W, base - theirs, left + 2 * BAR_W, base, GOLDEN)
        canvas.fill(left + BAR_W - 1, base + 1, left + BAR_W + 1, base + 1 + TICK, AXIS)
        _digits(canvas, str(panel.lengths[i]), left + BAR_W, base + TICK + 4)


def draw_acceptance(panels: list[AcceptPanel]) -> Canvas:
    if not panels:
        raise ValueError("an acceptance chart needs at least one configuration")
    canvas = Canvas(sum(panel_width(p) for p in panels) + len(panels) - 1,
                    TOP + PLOT_H + BOTTOM)
    x = 0
    for i, panel in enumerate(panels):
        if i:
            canvas.fill(x, 0, x + 1, canvas.height, SEPARATOR)
            x += 1
        _draw_panel(canvas, panel, x)
        x += panel_width(panel)
    return canvas
