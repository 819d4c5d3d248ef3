"""The PNG writer and the acceptance chart, read back by a decoder written here from the PNG
specification (signature, chunk CRCs, IHDR, zlib'd IDAT scanlines under filter 0)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.report.acceptance_chart import (
    BACKEND,
    GOLDEN,
    PLOT_H,
    AcceptPanel,
    bar_heights,
    draw_acceptance,
    panel_width,
)
from conformance.report.png import Canvas, encode_png

Pixels = list[list[tuple[int, int, int]]]


def decode(data: bytes) -> tuple[int, int, Pixels]:
    """(width, height, rows of RGB pixels) of an 8-bit RGB, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, bytes] = {}
    kinds, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        kinds.append(kind)
        at += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(
        ">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0  # filter type none
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(width)])
    return width, height, rows  # type: ignore[return-value]


def test_a_canvas_round_trips() -> None:
    canvas = Canvas(7, 5)
    canvas.fill(2, 1, 4, 3, (10, 20, 30))
    canvas.fill(-3, 4, 100, 9, (1, 2, 3))  # clipped to the canvas
    width, height, rows = decode(encode_png(canvas))
    assert (width, height) == (7, 5)
    assert rows[1][2] == rows[2][3] == (10, 20, 30) and rows[1][4] == (255, 255, 255)
    assert rows[4] == [(1, 2, 3)] * 7 and rows[0] == [(255, 255, 255)] * 7


def measured_bars(rows: Pixels, colour: tuple[int, int, int]) -> list[int]:
    """Heights of the bars of one colour, left to right: runs of that colour on the row just
    above the x axis, each measured upwards."""
    base = len(rows) - 1
    while colour not in rows[base] and base > 0:
        base -= 1
    heights, x = [], 0
    row = rows[base]
    while x < len(row):
        if row[x] == colour:
            y = base
            while y >= 0 and rows[y][x] == colour:
                y -= 1
            heights.append(base - y)
            while x < len(row) and row[x] == colour:
                x += 1
        x += 1
    return heights


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=2, max_size=7),
       st.lists(st.integers(0, 500), min_size=2, max_size=7))
def test_bar_heights_are_proportional_to_shares(ours: list[int], theirs: list[int]) -> None:
    panel = AcceptPanel("chain-s3-n4", {str(i + 1): n for i, n in enumerate(ours)},
                        {str(i + 1): n for i, n in enumerate(theirs)})
    heights = bar_heights(panel)
    shares = [(a / (sum(ours) or 1), b / (sum(theirs) or 1))
              for a, b in zip(ours + [0] * 7, theirs + [0] * 7, strict=False)]
    top = max(s for pair in shares for s in pair) or 1.0
    for (h_ours, h_theirs), (s_ours, s_theirs) in zip(heights, shares, strict=False):
        assert h_ours == pytest.approx(s_ours / top * PLOT_H, abs=0.5)
        assert h_theirs == pytest.approx(s_theirs / top * PLOT_H, abs=0.5)
    assert max(max(pair) for pair in heights) in (0, PLOT_H)


def test_the_chart_draws_each_configuration_as_measured() -> None:
    panels = [AcceptPanel("chain-s3-n4", {"1": 10, "2": 30, "4": 60}, {"1": 20, "2": 20, "4": 60}),
              AcceptPanel("chain-s5-n6", {"1": 5, "6": 5}, {"2": 1})]
    width, height, rows = decode(encode_png(draw_acceptance(panels)))
    assert width == sum(panel_width(p) for p in panels) + 1 and height > PLOT_H
    drawn_ours = measured_bars(rows, BACKEND)
    drawn_theirs = measured_bars(rows, GOLDEN)
    want = [h for p in panels for h in bar_heights(p)]
    assert drawn_ours == [a for a, _ in want if a]
    assert drawn_theirs == [b for _, b in want if b]
    assert drawn_ours[:3] == [25, 75, 150]  # 10 : 30 : 60 of the tallest share, 150 px
    with pytest.raises(ValueError, match="at least one"):
        draw_acceptance([])
