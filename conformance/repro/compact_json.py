"""JSON laid out for reading and diffing: structure indented one entry per line (as
``json.dumps(indent=...)``), but a list of numbers on one line, so a prompt's token ids are
one line of the file, not one line per token. It is ordinary JSON: any reader loads it as
the same data, and data holding no list of numbers comes out exactly as ``json.dumps``."""

from __future__ import annotations

import json
from collections.abc import Mapping


def dumps(value: object, indent: int = 1) -> str:
    """``value`` (JSON data: dicts with string keys, lists or tuples, scalars) as text."""
    return _layout(value, 0, indent)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _layout(value: object, depth: int, indent: int) -> str:
    pad, inner = " " * (depth * indent), " " * ((depth + 1) * indent)
    if isinstance(value, Mapping) and value:
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be strings, got {key!r:.40}")
        items = [f"{inner}{json.dumps(k)}: {_layout(v, depth + 1, indent)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)) and value and not all(map(_is_number, value)):
        items = [inner + _layout(v, depth + 1, indent) for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)  # a scalar, an empty container, a list of numbers: one line
