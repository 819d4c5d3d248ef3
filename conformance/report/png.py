"""A tiny RGB raster and its PNG encoding (zlib and struct only; no imaging library needed).

``Canvas`` holds 8-bit RGB pixels, row by row; ``fill`` paints a rectangle (clipped to the
canvas). ``encode_png`` writes the PNG signature, IHDR (8-bit truecolour, no interlace), one
IDAT with every scanline under filter type 0 (none), and IEND, each chunk with its CRC-32.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
SIGNATURE = b"\x89PNG\r\n\x1a\n"
BIT_DEPTH = 8
COLOUR_TYPE_RGB = 2


@dataclass
class Canvas:
    width: int
    height: int
    background: RGB = WHITE
    pixels: bytearray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1:
            raise ValueError(f"a canvas needs at least one pixel, got {self.width}x{self.height}")
        self.pixels = bytearray(bytes(self.background) * (self.width * self.height))

    def fill(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        """Paint columns ``x0..x1-1`` of rows ``y0..y1-1`` (y grows downwards)."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1:
            return
        run = bytes(colour) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(run)] = run


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(canvas: Canvas) -> bytes:
    stride = canvas.width * 3
    scanlines = b"".join(b"\x00" + bytes(canvas.pixels[y * stride:(y + 1) * stride])
                         for y in range(canvas.height))
    header = struct.pack(">IIBBBBB", canvas.width, canvas.height, BIT_DEPTH, COLOUR_TYPE_RGB,
                         0, 0, 0)  # compression, filter method, interlace: the only defaults
    return (SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(scanlines, 9))
            + _chunk(b"IEND", b""))
