"""refengine.data.matches_digest: a fixture file is hashed once per process while it stays
the same file, and every change to it is still caught (the manifest check's teeth)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

import refengine.data
from refengine.data import matches_digest


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files ``matches_digest`` reads, in order; the process's cache starts empty."""
    monkeypatch.setattr(refengine.data, "_HASHED_CLEAN", {})
    seen: list[Path] = []
    real = refengine.data.sha256_file

    def counted(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(refengine.data, "sha256_file", counted)
    return seen


def settled_file(path: Path, data: bytes) -> str:
    """``data`` written to ``path``, its times moved into the past; -> its digest. (Its ctime
    cannot be moved: the tests that need a settled file lower ``SETTLED_SECONDS``.)"""
    path.write_bytes(data)
    past = time.time() - 3600
    os.utime(path, (past, past))
    return hashlib.sha256(data).hexdigest()


def test_a_settled_file_is_hashed_once(tmp_path: Path, hashes: list[Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refengine.data, "SETTLED_SECONDS", -1.0)
    path = tmp_path / "weights"
    digest = settled_file(path, b"weights")
    assert all(matches_digest(path, digest) for _ in range(3))
    assert hashes == [path]


def test_a_fresh_file_is_hashed_every_time(tmp_path: Path, hashes: list[Path]) -> None:
    """Changed within the last SETTLED_SECONDS: a rewrite inside the file system's timestamp
    granularity could leave its times as they were, so nothing about it is remembered."""
    path = tmp_path / "weights"
    path.write_bytes(b"weights")
    digest = hashlib.sha256(b"weights").hexdigest()
    assert matches_digest(path, digest) and matches_digest(path, digest)
    assert hashes == [path, path]


def test_a_flipped_bit_with_the_old_times_is_caught(
        tmp_path: Path, hashes: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same inode, size and mtime (put back with utime) after a hash that was remembered:
    the change of ctime, which utime cannot undo, is enough."""
    monkeypatch.setattr(refengine.data, "SETTLED_SECONDS", -1.0)
    path = tmp_path / "weights"
    digest = settled_file(path, b"weights")
    assert matches_digest(path, digest)
    before = path.stat()
    time.sleep(0.02)  # past the coarse clock's tick: the rewrite moves ctime
    path.write_bytes(b"weightz")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert not matches_digest(path, digest)
    assert hashes == [path, path]


def test_a_file_changed_after_it_was_remembered_is_caught(
        tmp_path: Path, hashes: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refengine.data, "SETTLED_SECONDS", -1.0)
    path = tmp_path / "weights"
    digest = settled_file(path, b"weights")
    assert matches_digest(path, digest)
    time.sleep(0.02)  # past the coarse clock's tick: the rewrite moves ctime
    path.write_bytes(b"weightz")
    assert not matches_digest(path, digest)
    assert hashes == [path, path]


def test_another_digest_is_checked_again(tmp_path: Path, hashes: list[Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest that now expects another digest is not answered from the cache."""
    monkeypatch.setattr(refengine.data, "SETTLED_SECONDS", -1.0)
    path = tmp_path / "weights"
    digest = settled_file(path, b"weights")
    assert matches_digest(path, digest)
    assert not matches_digest(path, "0" * 64)
