"""A model converted once into a backend's cache directory: written into a temporary sibling
and renamed into place whole, so concurrent xdist workers never read half a directory (the
first rename wins, the others keep it). Shared by the backends that load specgate's fixtures
in another engine's layout (``ctranslate2/convert.py``, ``vllm/layout.py``)."""

from __future__ import annotations

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
