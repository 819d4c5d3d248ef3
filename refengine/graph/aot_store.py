"""The "aot" executor's packages on disk, kept so that the cache never hands out a package other
than the one that was built, nor one that crashed a process.

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

import atexit
import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from specwire.untrusted import UntrustedFileError, load_json

CACHE_ENV = "SPECGATE_CACHE_DIR"
BUDGET_ENV = "SPECGATE_CACHE_MAX_GB"
DEFAULT_BUDGET_GB = 4.0
# Free space a build must leave on the cache's disk beyond what it writes itself.
MIN_FREE_BYTES = 256 << 20
# A blob written or claimed by a build this recently is never collected: that build's sidecar,
# which names it, may not be written yet.
BLOB_GRACE_S = 3600.0
SIDECAR_FORMAT = 1
# Bounds on what the cache reads back (its files may be another user's or a damaged disk's):
# a sidecar names a few hundred constants at most, a marker three fields.
MAX_SIDECAR_BYTES = 4 << 20
MAX_MARKER_BYTES = 4096
MAX_RANK = 8
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")
_BLOB_NAME = re.compile(r"[0-9a-f]{64}")
# Inductor's setting that keeps a package's constants out of its shared object: the build
# hands them to the cache, which stores them in ``weights/``, and a load supplies them.
SHARED_WEIGHTS = {"aot_inductor.package_constants_in_so": False}
_CHUNK = 1 << 20


class CacheConfigError(ValueError):
    """A setting of the cache that cannot be used (its message is one line)."""


class CannotBuild(Exception):
    """A key with no usable package that cannot be built here; ``kind``: "unwritable" or
    "space". The caller runs the key in memory."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class Unusable(RuntimeError):
    """A package (or a blob it needs) that must not be run: deleted and rebuilt."""


def cache_dir() -> Path:
    """Where packages are kept: ``$SPECGATE_CACHE_DIR``, else the platform's user cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgate"


def budget_bytes() -> int:
    """``$SPECGATE_CACHE_MAX_GB`` (gigabytes, 10^9 bytes; default ``DEFAULT_BUDGET_GB``)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return int(DEFAULT_BUDGET_GB * 1e9)
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise CacheConfigError(f"${BUDGET_ENV} must be a positive number of gigabytes "
                               f"(e.g. 4 or 0.5), got {raw!r}")
    return int(gb * 1e9)


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class ArtefactKey:
    """Everything a package depends on; its file name is a digest of all of it. ``label``
    names the key for people (``decode-b1-kv256``) and carries the constants baked into its
    code (bucket, key width, a draft loop's top-k and steps), so it is part of the digest."""

    label: str
    weights: str
    inputs: str
    settings: str
    torch: str
    isa: str
    threads: int
    code: str

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{self.label}-{digest[:20]}.pt2"


Constants = dict[str, torch.Tensor]  # a package's constants, by the names its code gives them


@dataclass(frozen=True)
class Constant:
    """One constant a package runs on: a view of a blob's bytes."""

    blob: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    device: str

    def to_json(self) -> list[Any]:
        return [self.blob, self.dtype, list(self.shape), list(self.stride), self.offset,
                self.device]

    @classmethod
    def from_json(cls, raw: object) -> Constant:
        """Raises ValueError unless ``raw`` names a blob by its digest, a torch dtype, a shape
        and strides of at most ``MAX_RANK`` non-negative sizes, and a device: a sidecar is
        data, so nothing in it may name a path outside ``weights/`` or an attribute of torch
        other than a dtype."""
        if not isinstance(raw, list) or len(raw) != 6:
            raise ValueError("a constant is not a list of six fields")
        blob, dtype, shape, stride, offset, device = raw
        if not (isinstance(blob, str) and _BLOB_NAME.fullmatch(blob)):
            raise ValueError("a constant's blob is not a sha256 digest")
        if not (isinstance(dtype, str)
                and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype)):
            raise ValueError(f"a constant's dtype {str(dtype)[:40]!r} is not a torch dtype")
        sizes = [shape, stride, [offset]]
        if not all(isinstance(v, list) and len(v) <= MAX_RANK
                   and all(isinstance(n, int) and n >= 0 for n in v) for v in sizes):
            raise ValueError("a constant's shape, strides or offset are not small "
                             "non-negative integers")
        if not (isinstance(device, str) and _DEVICE.fullmatch(device)):
            raise ValueError(f"a constant's device {str(device)[:40]!r} is not cpu or cuda")
        return cls(blob, dtype, tuple(shape), tuple(stride), offset, device)


@dataclass(frozen=True)
class Sidecar:
    """What a build records beside its package, checked by every process's first load."""

    key: dict[str, Any]
    sources: str     # the digest of the engine's forward sources (what ``prune`` compares)
    size: int
    sha256: str
    created: float
    constants: dict[str, Constant]

    def to_bytes(self) -> bytes:
        fields = {"format": SIDECAR_FORMAT, "key": self.key, "sources": self.sources,
                  "size": self.size, "sha256": self.sha256, "created": self.created,
                  "constants": {n: c.to_json() for n, c in self.constants.items()}}
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def read(cls, path: Path) -> Sidecar:
        """Raises FileNotFoundError (none) or ValueError (not a sidecar of this format, or
        beyond the bounds any sidecar keeps)."""
        if not path.exists():
            raise FileNotFoundError(path)
        raw = load_json(path, "its sidecar", MAX_SIDECAR_BYTES)
        try:
            if not isinstance(raw, dict) or raw["format"] != SIDECAR_FORMAT:
                raise ValueError(f"not a sidecar of format {SIDECAR_FORMAT}")
            constants = raw["constants"]
            if not isinstance(constants, dict):
                raise ValueError("its constants are not a table")
            return cls(dict(raw["key"]), str(raw["sources"]), int(raw["size"]),
                       str(raw["sha256"]), float(raw["created"]),
                       {str(n): Constant.from_json(c) for n, c in constants.items()})
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"missing or malformed field {err}") from err


def sidecar_of(package: Path) -> Path:
    return package.with_name(package.name + ".json")


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file's bytes."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _write_file(path: Path, data: bytes) -> None:
    """Create or truncate ``path`` with ``data``. Every write of the cache goes through
    ``os.open``, ``os.replace``, ``os.mkdir``, ``os.unlink`` and ``os.utime``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    """A private name beside ``path``, ending as ``path`` does (the packager wants ".pt2")."""
    return path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}-{path.name}")


def _replace_atomically(path: Path, data: bytes) -> None:
    """A reader sees the old file or the whole new one, never a part."""
    temporary = _temporary(path)
    try:
        _write_file(temporary, data)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def _repack(package: Path) -> None:
    """Rewrite a built package smaller: without the C++ sources it was compiled from (the
    loader reads only the shared object and metadata), deflated (its code shrinks about
    five-fold; inflating costs about 8 ms a load)."""
    if not zipfile.is_zipfile(package):
        return
    packed = _temporary(package)
    try:
        with zipfile.ZipFile(package) as archive, \
                zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as out:
            for info in archive.infolist():
                if not info.filename.endswith(".cpp"):
                    out.writestr(info.filename, archive.read(info))
        os.replace(packed, package)
    finally:
        packed.unlink(missing_ok=True)


def open_package(path: str) -> Any:
    """A package's runner (``.run(inputs) -> outputs``), from torch's C++ loader directly:
    ``aoti_load_package`` would import inductor and try a newer archive format first, about
    2.4 s at a process's first load against 0.02 s. A torch without that loader (or with
    another signature) gets the public path."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    except (AttributeError, TypeError):
        return torch._inductor.aoti_load_package(path).loader


# --- this process's state ------------------------------------------------------------------
# Packages this process has loaded, by file: every engine on the same weights and key shares
# one (a package is called with the engine's own pool and buffers, and holds nothing else that
# a call changes), so a run that opens many engines loads each package once.
_LOADED: dict[Path, LoadedPackage] = {}
# Blobs this process has read and checked, by digest: every package holding a constant shares
# its memory.
_BLOBS: dict[tuple[str, str], torch.Tensor] = {}
# This process's loading markers not yet removed (their packages not yet called).
_PENDING: set[Path] = set()
# (cache root, CannotBuild kind) already warned about: one warning line per process.
_WARNED: set[tuple[str, str]] = set()


def _unmark(marker: Path | None) -> None:
    if marker is not None:
        _PENDING.discard(marker)
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)


@atexit.register
def _unmark_pending() -> None:
    """A process that ends normally crashed no package, whether or not it called them all."""
    for marker in list(_PENDING):
        if marker.name.endswith(f".{os.getpid()}"):  # not a forked parent's
            _unmark(marker)


class LoadedPackage:
    """A package opened by this process: its runner, the constants it runs on (the runner
    keeps only their addresses) and, until its first call returns, its loading marker."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor],
                 marker: Path | None) -> None:
        self.runner, self.constants, self.marker = runner, constants, marker

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return self.runner.run(inputs)
        finally:
            if self.marker is not None:  # the first call came back: it did not crash us
                _unmark(self.marker)
                self.marker = None


def _proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (Linux); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), to tell it from a later process given
    the same pid; None where that cannot be read."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def _alive(pid: int, host: str, started: str | None) -> bool:
    if host != socket.gethostname():
        return True  # another machine's process (a shared cache): its fate is unknown here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # ended (a zombie its parent has not reaped yet)
    return started is None or fields is None or len(fields) <= 19 or fields[19] == started


@dataclass(frozen=True)
class Marker:
    """A loading marker: which process, and whether it is still running."""

    path: Path
    pid: int
    alive: bool


@dataclass(frozen=True)
class Build:
    """One package compiled by this process: which key, in how many seconds."""

    label: str
    seconds: float


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


class PackageCache:
    """Compiled packages on disk, one file per ``ArtefactKey`` (module docstring)."""

    def __init__(self, root: Path | None = None, progress: TextIO | None = sys.stderr) -> None:
        """``progress``: where each build says which key it compiles and how long it took (a
        first run on a machine compiles for minutes), and where a rebuild or an eviction says
        why; None: silent. Raises ``CacheConfigError`` for a bad ``$SPECGATE_CACHE_MAX_GB``."""
        self.root = (root or cache_dir()) / "aot"
        self.progress = progress
        self.budget = budget_bytes()
        self.blob_grace_s = BLOB_GRACE_S
        self.builds: list[Build] = []  # the packages this instance compiled (the rest it loaded)

    # --- load or build ----------------------------------------------------------------------

    def load_or_build(self, key: ArtefactKey, build: Callable[[Path], Constants | None],
                      sources: str = "", space: int = 0) -> LoadedPackage:
        """The loaded package of ``key``: loaded already by this process, from the cache, or
        built by ``build(path)`` (which writes a package at ``path`` and returns the constants
        it must be given at load, by the code's names; None: none) and stored first.
        ``sources``: the forward sources' digest, for the sidecar; ``space``: bytes the build
        writes, beyond ``MIN_FREE_BYTES``. Raises ``CannotBuild`` where it needs a build that
        cannot happen here."""
        path = self.root / key.file_name()
        if path in _LOADED:
            return _LOADED[path]
        first = self._usable(key, path)
        if isinstance(first, LoadedPackage):
            return first
        # One build per key at a time on the machine: a process that finds another building
        # it (an xdist worker beside this one) waits, then loads what that one built.
        with self._locked(path):
            if path in _LOADED:
                return _LOADED[path]
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
            _unmark(marker)
            if isinstance(err, Exception):
                raise Unusable(f"its package does not load ({type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''})") from err
            raise
        with contextlib.suppress(OSError):
            os.utime(sidecar_of(path))  # its last use, for eviction
        _LOADED[path] = LoadedPackage(runner, constants, marker)
        return _LOADED[path]

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
        if (digest, device) in _BLOBS:
            return _BLOBS[(digest, device)]
        if (digest, "cpu") not in _BLOBS:
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
            _BLOBS[(digest, "cpu")] = flat
        if device != "cpu":
            _BLOBS[(digest, device)] = _BLOBS[(digest, "cpu")].to(device)
        return _BLOBS[(digest, device)]

    def _mark(self, path: Path) -> Path | None:
        """This process's loading marker for ``path``; None where it cannot be written (a
        read-only cache: nothing could be deleted there anyway)."""
        marker = self.root / "loading" / f"{path.name}.{os.getpid()}"
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": _process_start(os.getpid())}
        try:
            marker.parent.mkdir(exist_ok=True)
            _write_file(marker, json.dumps(record).encode())
        except OSError:
            return None
        _PENDING.add(marker)
        return marker

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
            found.append(Marker(marker, pid, _alive(pid, host, started)))
        return found

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
        temporary = _temporary(path)
        self._say(f"specgate: compiling {key.label} (once per machine, into {self.root})")
        start = time.perf_counter()
        try:
            constants = self._store_constants(build(temporary) or {})
            _repack(temporary)
            size, digest = file_digest(temporary)
            sidecar = Sidecar(asdict(key), sources, size, digest, time.time(), constants)
            # The sidecar first: whoever sees the package sees its sidecar.
            _replace_atomically(sidecar_of(path), sidecar.to_bytes())
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
        _replace_atomically(blob, data)

    def _say(self, line: str) -> None:
        if self.progress is not None:
            print(line, file=self.progress, flush=True)

    def fall_back(self, label: str, err: CannotBuild) -> None:
        """Say, once per process and cause, that keys run in memory instead of as packages."""
        if (str(self.root), err.kind) in _WARNED:
            return
        _WARNED.add((str(self.root), err.kind))
        print(f"specgate: warning: cannot build {label}: {err}; it and any other key without "
              f"a usable package run compiled in memory in this process",
              file=self.progress or sys.stderr, flush=True)

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
                    found.append(Leftover(p, p.stat().st_size, _alive(pid, socket.gethostname(),
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
            if e.path == keep or e.path in _LOADED:
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
                if (blob.name not in named and (blob.name, "cpu") not in _BLOBS
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
            if stale and e.path not in _LOADED:
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
