"""A model converted once into a backend's cache directory: written into a temporary sibling
and renamed into place whole, so concurrent xdist workers never read half a directory (the
first rename wins, the others keep it). Shared by the backends that load specgate's fixtures
in another engine's layout (``ctranslate2/convert.py``, ``vllm/layout.py``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def converted_once(target: Path, convert: Callable[[Path], None]) -> Path:
    """``target``, made by ``convert(staging)`` unless it exists already."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # another process renamed its conversion into place first: keep that one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def files_digest(source: Path, salt: str, length: int) -> str:
    """sha256 over ``salt`` and every file of ``source`` (name, size, bytes), cut to ``length``
    hex digits: a converted copy's key, so any change to the source makes a new one."""
    digest = hashlib.sha256(salt.encode())
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        digest.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:length]
