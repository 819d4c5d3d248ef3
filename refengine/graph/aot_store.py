"""The "aot" executor's packages on disk, kept so that the cache never hands out a package other
than the one that was built, nor one that crashed a process: ``PackageCache`` loads a package
after checking it, or builds it. Its file formats are ``aot_format.py``, what it holds and how
it is trimmed ``aot_index.py``, what this process holds of it ``aot_process.py``.

Under ``$SPECGATE_CACHE_DIR/aot`` (else ``$XDG_CACHE_HOME/specgate/aot``):

* ``<label>-<digest>.pt2``: a key's package, its code only, deflated: its constants (the
  weights, folded or packed) are kept out of it (``SHARED_WEIGHTS``) and given to it at load;
* ``<package>.json``, its sidecar, written before the package: the key, the digest of the
  engine's forward sources, the package's size and sha256, and the constants it runs on (the
  code's own name for each -> blob, dtype, shape, strides, offset). Its mtime is the package's
  last use;
* ``weights/<sha256>``: one constant's bytes, named by their digest, so every package holding
  the same constant shares one file (all keys of a model share its weights);
* ``loading/<package>.<pid>``: a process between opening a package and the end of its first
  call. One left by a dead process means the package crashed it;
* ``.lock-<package>``: held while that package is built (only to build: reading takes no lock);
* ``.tmp-<pid>-...``: a build's private files until they are renamed into place.

A process's first load of a package checks its bytes against the sidecar, and each blob's
against its name (later loads in the process reuse what was checked). A package whose bytes, sidecar
or blobs do not match, or whose marker names a dead process, is deleted and rebuilt, with one
line saying so. A key that cannot be built here (the directory is not writable, too little
free space) raises ``CannotBuild`` and the caller runs it in memory. After each build, packages
past the budget (``$SPECGATE_CACHE_MAX_GB``) are evicted, least recently used first, never one
this process has loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch

from refengine.graph import aot_process
from refengine.graph.aot_format import (
    MIN_FREE_BYTES,
    ArtefactKey,
    CannotBuild,
    Constant,
    Constants,
    Sidecar,
    Unusable,
    file_digest,
    gigabytes,
    open_package,
    repack,
    replace_atomically,
    sidecar_of,
    temporary_name,
    write_file,
)
from refengine.graph.aot_index import CacheIndex
from refengine.graph.aot_process import LoadedPackage, process_start, unmark


@dataclass(frozen=True)
class Build:
    """One package compiled by this process: which key, in how many seconds."""

    label: str
    seconds: float


class PackageCache(CacheIndex):
    """Compiled packages on disk, one file per ``ArtefactKey`` (module docstring): loaded after
    their integrity is checked, or built; what is there and its removal are the index's."""

    def __init__(self, root: Path | None = None, progress: TextIO | None = sys.stderr) -> None:
        """``progress``: where each build says which key it compiles and how long it took (a
        first run on a machine compiles for minutes), and where a rebuild or an eviction says
        why; None: silent. Raises ``CacheConfigError`` for a bad ``$SPECGATE_CACHE_MAX_GB``."""
        super().__init__(root, progress)
        self.builds: list[Build] = []  # the packages this instance compiled (the rest it loaded)


    def load_or_build(self, key: ArtefactKey, build: Callable[[Path], Constants | None],
                      sources: str = "", space: int = 0) -> LoadedPackage:
        """The loaded package of ``key``: loaded already by this process, from the cache, or
        built by ``build(path)`` (which writes a package at ``path`` and returns the constants
        it must be given at load, by the code's names; None: none) and stored first.
        ``sources``: the forward sources' digest, for the sidecar; ``space``: bytes the build
        writes, beyond ``MIN_FREE_BYTES``. Raises ``CannotBuild`` where it needs a build that
        cannot happen here."""
        path = self.root / key.file_name()
        if path in aot_process.LOADED:
            return aot_process.LOADED[path]
        first = self._usable(key, path)
        if isinstance(first, LoadedPackage):
            return first
        # One build per key at a time on the machine: a process that finds another building
        # it (an xdist worker beside this one) waits, then loads what that one built.
        with self._locked(path):
            if path in aot_process.LOADED:
                return aot_process.LOADED[path]
            found = self._usable(key, path)  # someone may have built or rebuilt it meanwhile
            if isinstance(found, LoadedPackage):
                return found
            if found is not None:  # what was wrong first (a corrupt blob, deleted, is missing)
                self._say(f"specgate: {key.label}: {first or found}: deleted, rebuilding it")
                self.delete(path)
            self._check_space(space)
            return self._build(key, path, build, sources)

    def _usable(self, key: ArtefactKey, path: Path) -> LoadedPackage | str | None:
        """The package loaded, or what is wrong with it, or None: there is none."""
        if not path.exists():
            return None
        crashed = [m for m in self.markers(path) if not m.alive]
        if crashed:
            return (f"its package crashed a process (pid {crashed[0].pid}) while loading or "
                    f"on its first call")
        try:
            sidecar = Sidecar.read(sidecar_of(path))
        except FileNotFoundError:
            return "its package has no sidecar (no digest was recorded)"
        except (OSError, ValueError) as err:
            return f"its sidecar is unreadable ({err})"
        if sidecar.key != asdict(key):
            return "its sidecar names another key"
        try:
            if file_digest(path) != (sidecar.size, sidecar.sha256):
                return "its package's bytes differ from those recorded when it was built"
            return self._open(path, sidecar)
        except FileNotFoundError:
            return None  # deleted meanwhile (evicted, or rebuilt by another process)
        except Unusable as err:
            return str(err)

    def _open(self, path: Path, sidecar: Sidecar) -> LoadedPackage:
        """Load a checked package, marked as loading until its first call returns."""
        constants = {name: self._constant(c) for name, c in sidecar.constants.items()}
        marker = self._mark(path)
        try:
            runner = open_package(str(path))
            if constants:  # by the code's own names; kept by us, not copied (user-managed)
                runner.update_constant_buffer(constants, False, True, True)
        except BaseException as err:
            unmark(marker)
            if isinstance(err, Exception):
                raise Unusable(f"its package does not load ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''})") from err
            raise
        with contextlib.suppress(OSError):
            os.utime(sidecar_of(path))  # its last use, for eviction
        aot_process.LOADED[path] = LoadedPackage(runner, constants, marker)
        return aot_process.LOADED[path]

    def _constant(self, c: Constant) -> torch.Tensor:
        flat = self._blob(c.blob, c.device)
        try:
            return flat.view(getattr(torch, c.dtype.removeprefix("torch."))).as_strided(
                c.shape, c.stride, c.offset)
        except RuntimeError as err:  # a view past the blob's end, or of a size it cannot have
            raise Unusable(f"a constant does not fit its weights blob {c.blob[:12]} "
                           f"({str(err).splitlines()[0][:120]})") from None

    def _blob(self, digest: str, device: str) -> torch.Tensor:
        """A blob's bytes, read and checked once per process."""
        if (digest, device) in aot_process.BLOBS:
            return aot_process.BLOBS[(digest, device)]
        if (digest, "cpu") not in aot_process.BLOBS:
            path = self.root / "weights" / digest
            try:
                flat = torch.empty(path.stat().st_size, dtype=torch.uint8)  # 64-byte aligned
                with open(path, "rb") as f:
                    read = f.readinto(memoryview(flat.numpy()))
            except FileNotFoundError:
                raise Unusable(f"its weights blob {digest[:12]} is missing") from None
            except OSError as err:
                raise Unusable(f"its weights blob {digest[:12]} is unreadable ({err})") from None
            if read != flat.numel() or hashlib.sha256(flat.numpy()).hexdigest() != digest:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                raise Unusable(f"its weights blob {digest[:12]} is corrupt")
            aot_process.BLOBS[(digest, "cpu")] = flat
        if device != "cpu":
            aot_process.BLOBS[(digest, device)] = aot_process.BLOBS[(digest, "cpu")].to(device)
        return aot_process.BLOBS[(digest, device)]

    def _mark(self, path: Path) -> Path | None:
        """This process's loading marker for ``path``; None where it cannot be written (a
        read-only cache: nothing could be deleted there anyway)."""
        marker = self.root / "loading" / f"{path.name}.{os.getpid()}"
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": process_start(os.getpid())}
        try:
            marker.parent.mkdir(exist_ok=True)
            write_file(marker, json.dumps(record).encode())
        except OSError:
            return None
        aot_process.PENDING.add(marker)
        return marker

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        lock = path.with_name(f".lock-{path.name}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CannotBuild("unwritable", f"the cache directory {self.root} is not writable "
                              f"({err.strerror or err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _check_space(self, space: int) -> None:
        need, free = MIN_FREE_BYTES + space, shutil.disk_usage(self.root).free
        if free < need:
            raise CannotBuild("space", f"only {gigabytes(free)} free on the disk of "
                              f"{self.root}, a build needs {gigabytes(need)}")

    def _build(self, key: ArtefactKey, path: Path, build: Callable[[Path], Constants | None],
               sources: str) -> LoadedPackage:
        # private to this build, and still a ".pt2" (the packager insists on the suffix)
        temporary = temporary_name(path)
        self._say(f"specgate: compiling {key.label} (once per machine, into {self.root})")
        start = time.perf_counter()
        try:
            constants = self._store_constants(build(temporary) or {})
            repack(temporary)
            size, digest = file_digest(temporary)
            sidecar = Sidecar(asdict(key), sources, size, digest, time.time(), constants)
            # The sidecar first: whoever sees the package sees its sidecar.
            replace_atomically(sidecar_of(path), sidecar.to_bytes())
            os.replace(temporary, path)  # atomic: a reader sees no package or a whole one
        finally:
            temporary.unlink(missing_ok=True)
        self.builds.append(Build(key.label, time.perf_counter() - start))
        self._say(f"specgate: compiled {key.label} in {self.builds[-1].seconds:.1f} s "
                  f"({len(self.builds)} this run, "
                  f"{sum(b.seconds for b in self.builds):.0f} s in all)")
        self.evict(keep=path)
        return self._open(path, sidecar)

    def _store_constants(self, tensors: Constants) -> dict[str, Constant]:
        """Each constant's whole storage as a blob (once per storage); -> what the sidecar
        lists."""
        blobs: dict[tuple[str, int], str] = {}  # (device, address) -> digest
        constants = {}
        for name, t in tensors.items():
            if t.layout != torch.strided:
                raise RuntimeError(f"constant {name} is a {t.layout} tensor: only strided "
                                   f"ones can be shared")
            storage = t.untyped_storage()
            where = (str(t.device), storage.data_ptr())
            if where not in blobs:
                # whole storage as bytes (``bytes(storage)`` would iterate them in Python)
                data = torch.empty(0, dtype=torch.uint8).set_(storage.cpu()).numpy().tobytes()
                blobs[where] = hashlib.sha256(data).hexdigest()
                self._put_blob(blobs[where], data)
            constants[name] = Constant(blobs[where], str(t.dtype), tuple(t.shape),
                                       tuple(t.stride()), t.storage_offset(), str(t.device))
        return constants

    def _put_blob(self, digest: str, data: bytes) -> None:
        blob = self.root / "weights" / digest
        try:
            if file_digest(blob)[1] == digest:
                os.utime(blob)  # claimed by this build: not collected before its sidecar lands
                return
        except FileNotFoundError:
            pass
        blob.parent.mkdir(exist_ok=True)
        replace_atomically(blob, data)


    def fall_back(self, label: str, err: CannotBuild) -> None:
        """Say, once per process and cause, that keys run in memory instead of as packages."""
        if (str(self.root), err.kind) in aot_process.WARNED:
            return
        aot_process.WARNED.add((str(self.root), err.kind))
        print(f"specgate: warning: cannot build {label}: {err}; it and any other key without "
              f"a usable package run compiled in memory in this process",
              file=self.progress or sys.stderr, flush=True)
