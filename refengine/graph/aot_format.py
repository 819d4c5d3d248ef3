"""The "aot" cache's files and settings: where the cache lives and its size budget, what names a
package (``ArtefactKey``), what a build records beside it (``Sidecar``: its digest and the
constants it runs on, each a view of a ``weights/`` blob), and the file operations every write
of the cache goes through (a reader sees an old file or a whole new one, never a part).
``aot_store.py`` describes the layout on disk.

A sidecar is data read back from disk (another user's, or a damaged disk's): nothing in it may
name a path outside ``weights/`` or an attribute of torch other than a dtype, and it is read
within bounds (``MAX_SIDECAR_BYTES``, ``MAX_RANK``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import uuid
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specwire.untrusted import load_json

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


def write_file(path: Path, data: bytes) -> None:
    """Create or truncate ``path`` with ``data``. Every write of the cache goes through
    ``os.open``, ``os.replace``, ``os.mkdir``, ``os.unlink`` and ``os.utime``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """A private name beside ``path``, ending as ``path`` does (the packager wants ".pt2")."""
    return path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}-{path.name}")


def replace_atomically(path: Path, data: bytes) -> None:
    """A reader sees the old file or the whole new one, never a part."""
    temporary = temporary_name(path)
    try:
        write_file(temporary, data)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def repack(package: Path) -> None:
    """Rewrite a built package smaller: without the C++ sources it was compiled from (the
    loader reads only the shared object and metadata), deflated (its code shrinks about
    five-fold; inflating costs about 8 ms a load)."""
    if not zipfile.is_zipfile(package):
        return
    packed = temporary_name(package)
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
