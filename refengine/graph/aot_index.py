"""What the "aot" cache holds and how it is trimmed: its packages (each with its sidecar and last
use), weight blobs, loading markers and builds' leftovers (``info``); eviction past the size
budget, least recently used first and never a package this process loaded (``evict``); what
the current code can never load (``prune``); everything (``clear``). ``aot_store.py``
describes the layout on disk; ``PackageCache`` builds on this index.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from refengine.graph import aot_process
from refengine.graph.aot_format import (
    BLOB_GRACE_S,
    BUDGET_ENV,
    MAX_MARKER_BYTES,
    Sidecar,
    budget_bytes,
    cache_dir,
    gigabytes,
    sidecar_of,
)
from refengine.graph.aot_process import Marker, alive
from specwire.untrusted import UntrustedFileError, load_json


@dataclass(frozen=True)
class Entry:
    """A package file as ``info`` lists it."""

    path: Path
    size: int
    last_used: float
    sidecar: Sidecar | None


@dataclass(frozen=True)
class Leftover:
    """A temporary file of a build, or of a sidecar or blob write."""

    path: Path
    size: int
    alive: bool  # its writer is still running


@dataclass(frozen=True)
class CacheInfo:
    root: Path
    packages: list[Entry]
    blobs: int
    blob_bytes: int
    temporaries: list[Leftover]
    markers: list[Marker]
    budget: int
    free: int | None

    @property
    def total(self) -> int:
        return sum(e.size for e in self.packages) + self.blob_bytes


@dataclass(frozen=True)
class Pruned:
    packages: list[str]
    bytes: int


class CacheIndex:
    """The packages, blobs and markers under a cache root, and their removal (module
    docstring)."""

    def __init__(self, root: Path | None = None, progress: TextIO | None = sys.stderr) -> None:
        """``progress``: where an eviction says what it removed; None: silent. Raises
        ``CacheConfigError`` for a bad ``$SPECGATE_CACHE_MAX_GB``."""
        self.root = (root or cache_dir()) / "aot"
        self.progress = progress
        self.budget = budget_bytes()
        self.blob_grace_s = BLOB_GRACE_S

    def _say(self, line: str) -> None:
        if self.progress is not None:
            print(line, file=self.progress, flush=True)

    def markers(self, path: Path | None = None) -> list[Marker]:
        """Loading markers (of ``path``, or all), each with whether its process runs."""
        found = []
        pattern = f"{path.name}.*" if path is not None else "*"
        for marker in sorted((self.root / "loading").glob(pattern)):
            try:
                record = load_json(marker, "a loading marker", MAX_MARKER_BYTES)
                if not isinstance(record, dict):
                    continue
                pid, host, started = int(record["pid"]), str(record["host"]), record["started"]
                started = None if started is None else str(started)
                if pid <= 0:
                    continue  # not a process: nothing we wrote
            except (UntrustedFileError, ValueError, KeyError, TypeError):
                continue  # torn by a process that died writing it: it loaded nothing
            found.append(Marker(marker, pid, alive(pid, host, started)))
        return found


    # --- what is there ----------------------------------------------------------------------

    def entries(self) -> list[Path]:
        """The packages (not the temporaries of builds under way or killed)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.pt2") if not p.name.startswith("."))

    def _blob_files(self) -> list[Path]:
        weights = self.root / "weights"
        return sorted(p for p in weights.iterdir() if not p.name.startswith(".")) \
            if weights.is_dir() else []

    def _entry(self, path: Path) -> Entry | None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        sidecar: Sidecar | None
        try:
            sidecar = Sidecar.read(sidecar_of(path))
            used = sidecar_of(path).stat().st_mtime
            size += sidecar_of(path).stat().st_size
        except (OSError, ValueError):
            sidecar, used = None, path.stat().st_mtime
        return Entry(path, size, used, sidecar)

    def temporaries(self) -> list[Leftover]:
        found = []
        for folder in (self.root, self.root / "weights"):
            for p in sorted(folder.glob(".tmp-*")) if folder.is_dir() else []:
                with contextlib.suppress(OSError, ValueError):
                    pid = int(p.name.split("-")[1])
                    found.append(Leftover(p, p.stat().st_size, alive(pid, socket.gethostname(),
                                                                      None)))
        return found

    def info(self) -> CacheInfo:
        entries = [e for e in map(self._entry, self.entries()) if e is not None]
        blobs = self._blob_files()
        free = shutil.disk_usage(self.root).free if self.root.is_dir() else None
        return CacheInfo(self.root, entries, len(blobs), sum(b.stat().st_size for b in blobs),
                         self.temporaries(), self.markers(), self.budget, free)

    # --- removing ---------------------------------------------------------------------------

    def delete(self, path: Path) -> None:
        """A package, its sidecar and the markers dead processes left for it."""
        for p in (path, sidecar_of(path), *(m.path for m in self.markers(path) if not m.alive)):
            p.unlink(missing_ok=True)

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Past the budget: delete the least recently used packages (never ``keep`` nor one
        this process loaded) and the blobs no package names any more; one line says so."""
        entries = [e for e in map(self._entry, self.entries()) if e is not None]
        blob_bytes = sum(b.stat().st_size for b in self._blob_files())
        total = sum(e.size for e in entries) + blob_bytes
        if total <= self.budget:
            return []
        evicted: list[Path] = []
        for e in sorted(entries, key=lambda e: e.last_used):
            if total <= self.budget:
                break
            if e.path == keep or e.path in aot_process.LOADED:
                continue
            with contextlib.suppress(OSError):
                self.delete(e.path)
                evicted.append(e.path)
                total -= e.size
        total -= self.collect_blobs()
        over = (" (still over: the rest is in use by this process)"
                if total > self.budget else "")
        self._say(f"specgate: cache over its budget of {gigabytes(self.budget)} "
                  f"(${BUDGET_ENV}): evicted {len(evicted)} least recently used package(s), "
                  f"{gigabytes(total)} left{over}")
        return evicted

    def collect_blobs(self) -> int:
        """Delete the blobs no sidecar names (past the grace period); -> bytes freed."""
        named: set[str] = set()
        for path in self.entries():
            with contextlib.suppress(OSError, ValueError):
                named |= {c.blob for c in Sidecar.read(sidecar_of(path)).constants.values()}
        freed, now = 0, time.time()
        for blob in self._blob_files():
            with contextlib.suppress(OSError):
                stat = blob.stat()
                if (blob.name not in named and (blob.name, "cpu") not in aot_process.BLOBS
                        and now - stat.st_mtime >= self.blob_grace_s):
                    blob.unlink()
                    freed += stat.st_size
        return freed

    def prune(self, sources: str, torch_version: str) -> Pruned:
        """Delete what the current code can never load: packages of other forward sources or
        another torch, without a readable sidecar, or that crashed a process; sidecars without
        a package, dead builds' temporaries, and the blobs no package names."""
        removed, freed = [], 0
        for e in [e for e in map(self._entry, self.entries()) if e is not None]:
            stale = (e.sidecar is None or e.sidecar.sources != sources
                     or e.sidecar.key.get("torch") != torch_version
                     or any(not m.alive for m in self.markers(e.path)))
            if stale and e.path not in aot_process.LOADED:
                self.delete(e.path)
                e.path.with_name(f".lock-{e.path.name}").unlink(missing_ok=True)
                removed.append(e.path.name)
                freed += e.size
        now = time.time()
        for sidecar in self.root.glob("*.pt2.json") if self.root.is_dir() else []:
            with contextlib.suppress(OSError):  # a build writes its sidecar before its package
                if (not sidecar.with_suffix("").exists()
                        and now - sidecar.stat().st_mtime >= self.blob_grace_s):
                    sidecar.unlink()
        for marker in self.markers():
            if not marker.alive:
                marker.path.unlink(missing_ok=True)
        for leftover in self.temporaries():
            if not leftover.alive:
                leftover.path.unlink(missing_ok=True)
                freed += leftover.size
        return Pruned(removed, freed + self.collect_blobs())

    def clear(self) -> int:
        """Delete every package, sidecar, blob, marker and lock file, and any temporary a
        killed build left; -> packages deleted."""
        removed = 0
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                    continue
                p.unlink(missing_ok=True)
                removed += p.suffix == ".pt2" and not p.name.startswith(".")
        return removed
