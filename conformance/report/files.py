"""Output files a command writes at the end of a long run: checked before any work, written
atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from conformance.plan.usage import UsageError


def output_file(text: str, option: str = "--json") -> Path:
    """A file the command will write at the end: checked (and its directory created) before
    any work, so a long run never ends in an error that loses its figures; ``option`` names it
    in the error."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{option} {text}: is a directory, expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as err:
        raise UsageError(f"{option} {text}: cannot write there ({err.strerror or err})") from None
    return path


def write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)
