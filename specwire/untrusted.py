"""Reading files specgate did not write in this process: repro files, known-failures lists,
shards' report.json, durations tables, cache metadata. They travel in bug reports and CI
artefacts, fork PRs included, so each is read as data under hard bounds: a regular file, at
most ``max_bytes``, UTF-8, nested at most ``max_depth`` deep, every integer within 64 bits.
Anything else raises ``UntrustedFileError`` with one line naming the file and the problem,
never a RecursionError, MemoryError or the interpreter's digit-limit ValueError.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 fallback
    import tomli as tomllib

MAX_DEPTH = 32          # the deepest file specgate writes nests 7 levels
MAX_INT = 2**63 - 1     # every count, seed and id specgate writes fits a signed 64-bit integer
MAX_INT_DIGITS = 20     # what a JSON integer of that size needs at most (with a minus sign)
MiB = 2**20


class UntrustedFileError(ValueError):
    """A file that is not the data it should be; the message is one line naming it and why."""


def read_text(path: Path, where: str, max_bytes: int) -> str:
    """The file's text, refused unless it is a regular UTF-8 file of at most ``max_bytes``
    (a device or a pipe, such as /dev/zero, is never read: it has no end)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UntrustedFileError(f"{where}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise UntrustedFileError(f"{where}: cannot read it ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise UntrustedFileError(f"{where}: larger than {max_bytes / MiB:g} MiB, the most "
                                 "specgate reads of such a file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UntrustedFileError(f"{where}: not UTF-8 text") from None


def check_shape(value: object, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Nesting and integers of parsed data, walked without recursion (the walk itself must
    not be what a deep file breaks)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            if (isinstance(item, int) and not isinstance(item, bool)
                    and not -MAX_INT - 1 <= item <= MAX_INT):
                raise UntrustedFileError(f"{where}: an integer beyond 64 bits")
            continue
        if depth >= max_depth:
            raise UntrustedFileError(f"{where}: nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UntrustedFileError("an integer beyond 64 bits")
    return int(text)


def _no_constant(name: str) -> float:
    raise UntrustedFileError(f"{name} is not JSON")


def parse_json(text: str, where: str, max_depth: int = MAX_DEPTH) -> object:
    """JSON text as data within the bounds; UntrustedFileError naming ``where`` otherwise."""
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise UntrustedFileError(f"{where}: nested deeper than {max_depth} levels") from None
    except UntrustedFileError as err:
        raise UntrustedFileError(f"{where}: {err}") from None
    except ValueError as err:
        raise UntrustedFileError(f"{where}: not JSON ({err})") from None
    check_shape(value, where, max_depth)
    return value


def load_json(path: Path, where: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> object:
    return parse_json(read_text(path, where, max_bytes), where, max_depth)


def load_toml(path: Path, where: str, max_bytes: int, max_depth: int = MAX_DEPTH
              ) -> dict[str, object]:
    """A TOML file as data within the bounds; UntrustedFileError naming ``where`` otherwise."""
    text = read_text(path, where, max_bytes)
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise UntrustedFileError(f"{where}: nested deeper than {max_depth} levels") from None
    except ValueError as err:  # TOMLDecodeError, and int()'s digit limit on a huge integer
        raise UntrustedFileError(f"{where}: not valid TOML "
                                 f"({' '.join(str(err).split())[:200]})") from None
    check_shape(value, where, max_depth)
    return value


def contained(base: Path, *parts: str) -> Path:
    """``base/parts...`` for names that came from a file: each part must be a plain name (no
    separator, not ``.`` or ``..``) and the result must resolve inside ``base``, so a name
    like ``../../x`` can never make specgate write outside its output directory."""
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
            raise UntrustedFileError(f"{part!r} is not a plain file name")
    path = base.joinpath(*parts)
    root = base.resolve()
    if not path.resolve().is_relative_to(root):
        raise UntrustedFileError(f"{path} lies outside {base}")
    return path
