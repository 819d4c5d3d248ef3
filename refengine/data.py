"""Where the bundled fixtures and golden traces live, in a checkout or in an installed wheel.

In a checkout they are the top-level ``fixtures/`` and ``golden/`` folders; a wheel carries the
same folders as ``refengine/_fixtures`` and ``refengine/_golden`` (see pyproject.toml).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _bundled(checkout_name: str, wheel_name: str, marker: str) -> Path:
    checkout = _PACKAGE.parent / checkout_name
    return checkout if (checkout / marker).exists() else _PACKAGE / wheel_name


def fixtures_root() -> Path:
    return _bundled("fixtures", "_fixtures", "build.py")


def golden_root() -> Path:
    return _bundled("golden", "_golden", "README.md")


MANIFEST_SKIP = frozenset({"MANIFEST.json", "build.py", "__init__.py"})  # not fixture data


def fixture_names() -> list[str]:
    root = fixtures_root()
    return sorted(p.parent.name for p in root.glob("*/config.json"))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A file's identity when it last hashed clean: (digest, inode, size, mtime_ns, ctime_ns).
_HASHED_CLEAN: dict[Path, tuple[str, int, int, int, int]] = {}
# A file changed this recently may change again within the file system's timestamp granularity
# without its times moving: hashed every time until it is older (git's "racily clean" rule).
SETTLED_SECONDS = 2.0


def matches_digest(path: Path, digest: str) -> bool:
    """Whether ``path`` hashes to ``digest``; a file that hashed clean before and whose inode,
    size and times have not moved since (and had settled then) is not read again: an engine
    opened a hundred times in a process hashes its fixture once."""
    st = path.stat()
    identity = (digest, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if _HASHED_CLEAN.get(path) == identity:
        return True
    if sha256_file(path) != digest:
        return False
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > SETTLED_SECONDS * 1e9:
        _HASHED_CLEAN[path] = identity
    return True


def verify_fixture(name: str) -> None:
    """Check every file of fixture ``name`` against MANIFEST.json; ValueError on a mismatch."""
    root = fixtures_root()
    manifest = json.loads((root / "MANIFEST.json").read_text())
    prefix = f"{name}/"
    entries = {k: v for k, v in manifest.items() if k.startswith(prefix)}
    if not entries:
        raise ValueError(f"manifest: fixture {name!r} has no entries in {root / 'MANIFEST.json'}")
    for rel, digest in sorted(entries.items()):
        path = root / rel
        if not path.exists():
            raise FileNotFoundError(f"fixture file missing: {path}")
        if not matches_digest(path, digest):
            raise ValueError(f"manifest hash mismatch: {rel} (file changed since the build; "
                             "rebuild with fixtures/build.py or restore it)")


def resolve_model_dir(model: str) -> Path:
    """A fixture name (checked against the manifest) or an existing HF-format directory."""
    if model in fixture_names():
        verify_fixture(model)
        return fixtures_root() / model
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if "/" in model or model.startswith("."):
        raise FileNotFoundError(f"model directory does not exist: {model}")
    known = ", ".join(fixture_names()) or "none found"
    raise FileNotFoundError(f"unknown fixture {model!r} (known fixtures: {known})")
