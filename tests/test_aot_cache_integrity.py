"""The compiled-key cache never lies (``refengine/graph/aot_store.py``): a package whose bytes,
sidecar or weights blob were damaged is deleted and rebuilt, never run; one that killed a
process between its loading marker and the end of its first call is rebuilt by the next
process; a read-only cache still loads what it holds and runs what it cannot build in memory,
with one warning; the cache keeps to its budget (least recently used first, never a package
this process loaded) and to the disk's free space; ``specgate cache prune|info|clear``.

Packages here are fakes (no compiler): a file holding b"package", whose build may hand over
constants for the cache to store, as a real build does (``SHARED_WEIGHTS``)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.cli import main
from refengine.graph import aot, aot_format, aot_process, aot_store
from refengine.graph.aot import AotPackages
from refengine.graph.aot_format import (
    ArtefactKey,
    CacheConfigError,
    CannotBuild,
    budget_bytes,
    sidecar_of,
)
from refengine.graph.aot_store import PackageCache
from refengine.graph.compiled import CompiledKey
from tests.test_loader_fuzz import mutated

REPO = Path(__file__).resolve().parents[1]
KEY = ArtefactKey("decode-b1-kv256", "w" * 64, "torch.int64[1]@cpu", "{}", "2.13.0", "AVX2", 2,
                  "c" * 64)


class Runner:
    """A fake package's runner: the constants it was given; ``run`` returns its inputs and
    its constants, by name."""

    def __init__(self, path: str) -> None:
        self.path, self.constants = path, dict[str, torch.Tensor]()

    def update_constant_buffer(self, constants: dict[str, torch.Tensor], use_inactive: bool,
                               validate_full_updates: bool, user_managed: bool) -> None:
        assert not use_inactive and validate_full_updates and user_managed
        self.constants = constants

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [*inputs, *(self.constants[name] for name in sorted(self.constants))]


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Runner]:
    """``open_package`` that opens a file holding b"package" (a real one fails on anything
    else, or crashes); the process has loaded nothing yet. -> the runners it opened."""
    runners: list[Runner] = []

    def load(path: str) -> Runner:
        if Path(path).read_bytes() != b"package":
            raise RuntimeError(f"not a package: {path}")
        runners.append(Runner(path))
        return runners[-1]

    monkeypatch.setattr(aot_store, "open_package", load)
    later_process(monkeypatch)
    return runners


def later_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's cache state as a fresh process's: nothing loaded, read or warned."""
    for state in ("LOADED", "BLOBS", "PENDING", "WARNED"):
        monkeypatch.setattr(aot_process, state, type(getattr(aot_process, state))())


def write_package(path: Path) -> None:
    path.write_bytes(b"package")


def not_again(path: Path) -> None:
    pytest.fail("a valid package was built again")


def with_constants(constants: dict[str, torch.Tensor]
                   ) -> Callable[[Path], dict[str, torch.Tensor]]:
    """A build whose package takes ``constants`` at load (kept out of it, as a real one)."""
    def build(path: Path) -> dict[str, torch.Tensor]:
        write_package(path)
        return constants
    return build


def rebuild_lines(said: io.StringIO) -> list[str]:
    return [line for line in said.getvalue().splitlines() if "rebuilding" in line]


# --- damaged packages ----------------------------------------------------------------------

def test_a_package_with_damaged_bytes_is_deleted_and_rebuilt(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch) -> None:
    """Overwritten bytes of the same length (the weights region of a real package, a zeroed
    code section): the digest recorded at build time no longer matches, so the package is
    never opened; it is deleted and rebuilt, with one line."""
    PackageCache(tmp_path).load_or_build(KEY, write_package)
    package = tmp_path / "aot" / KEY.file_name()
    package.write_bytes(b"pockage")  # same size, other bytes
    later_process(monkeypatch)
    said = io.StringIO()
    cache = PackageCache(tmp_path, progress=said)
    cache.load_or_build(KEY, write_package)
    assert len(cache.builds) == 1 and package.read_bytes() == b"package"
    assert [r.path for r in opened] == [str(package)] * 2  # the damaged one was never opened
    [line] = rebuild_lines(said)
    assert f"specgate: {KEY.label}: its package's bytes differ" in line


@pytest.mark.parametrize("sidecar", [b"{not json", b'{"format": 1}', b""])
def test_a_damaged_sidecar_means_a_rebuild(tmp_path: Path, opened: list[Runner],
                                           monkeypatch: pytest.MonkeyPatch,
                                           sidecar: bytes) -> None:
    PackageCache(tmp_path).load_or_build(KEY, write_package)
    sidecar_of(tmp_path / "aot" / KEY.file_name()).write_bytes(sidecar)
    later_process(monkeypatch)
    said = io.StringIO()
    cache = PackageCache(tmp_path, progress=said)
    cache.load_or_build(KEY, write_package)
    assert len(cache.builds) == 1 and "its sidecar is unreadable" in rebuild_lines(said)[0]


def _sidecar_with_constant(path: Path, **change: Any) -> bytes:
    """The sidecar at ``path`` with its one constant's fields changed."""
    raw = json.loads(path.read_bytes())
    [(name, fields)] = raw["constants"].items()
    order = ["blob", "dtype", "shape", "stride", "offset", "device"]
    raw["constants"][name] = [change.get(f, v) for f, v in zip(order, fields, strict=True)]
    return json.dumps(raw).encode()


@pytest.mark.parametrize("change", [
    {"blob": "../../../outside"}, {"blob": "OUTSIDE"}, {"dtype": "load"},
    {"dtype": "torch.save"}, {"shape": [1] * 9}, {"shape": [-1]}, {"offset": 2**40},
    {"shape": [10**6]}, {"device": "../x"}, {"device": ["cpu"]}])
def test_a_sidecar_is_data(tmp_path: Path, opened: list[Runner],
                           monkeypatch: pytest.MonkeyPatch, change: dict[str, Any]) -> None:
    """A sidecar names blobs, dtypes and views; one that names a path outside ``weights/``,
    an attribute of torch that is not a dtype, or a view its blob cannot hold is not
    believed: the key is rebuilt, with one line, and nothing outside the cache is read or
    deleted (a blob that fails its check is deleted: ``../../../outside`` would have been)."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * 4096)
    cache_root = tmp_path / "cache"
    PackageCache(cache_root).load_or_build(KEY, with_constants({"w": torch.ones(4)}))
    sidecar = sidecar_of(cache_root / "aot" / KEY.file_name())
    # (an absolute path to a file of the test's own: a regression must never reach the system)
    change = {f: str(outside) if v == "OUTSIDE" else v for f, v in change.items()}
    sidecar.write_bytes(_sidecar_with_constant(sidecar, **change))
    later_process(monkeypatch)
    said = io.StringIO()
    cache = PackageCache(cache_root, progress=said)
    got = cache.load_or_build(KEY, with_constants({"w": torch.ones(4)})).run([])
    torch.testing.assert_close(got, [torch.ones(4)], rtol=0, atol=0)
    [line] = rebuild_lines(said)
    assert len(cache.builds) == 1 and "\n" not in line.strip()
    assert outside.read_bytes() == b"\0" * 4096


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_sidecars_and_markers_are_rebuilt_never_believed(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch,
        data: st.DataObject) -> None:
    """A sidecar or loading marker damaged any way (values, bytes, deep nesting, huge
    integers): the next load either runs the package on its own constants or rebuilds it,
    with at most one line, and never raises."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # fresh each example (not a draw: replays)
    PackageCache(root).load_or_build(KEY, with_constants({"w": torch.arange(4.0)}))
    package = root / "aot" / KEY.file_name()
    marker = root / "aot" / "loading" / f"{package.name}.{os.getpid()}"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(json.dumps({"pid": os.getpid(), "host": "h", "started": None}))
    sidecar = json.loads(sidecar_of(package).read_bytes())
    sidecar_of(package).write_text(json.dumps({**sidecar, "created": 0.0}, sort_keys=True))
    # (the same seed text every example: Hypothesis replays its draws against it)
    target = data.draw(st.sampled_from([sidecar_of(package), marker]))
    target.write_bytes(data.draw(mutated(target.read_text())))
    later_process(monkeypatch)
    said = io.StringIO()
    got = PackageCache(root, progress=said).load_or_build(
        KEY, with_constants({"w": torch.arange(4.0)})).run([])
    torch.testing.assert_close(got, [torch.arange(4.0)], rtol=0, atol=0)
    assert len(rebuild_lines(said)) <= 1 and "Traceback" not in said.getvalue()


def test_a_sidecar_of_another_key_is_not_believed(tmp_path: Path, opened: list[Runner],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PackageCache(tmp_path)
    cache.load_or_build(KEY, write_package)
    other = replace(KEY, threads=8)
    cache.load_or_build(other, write_package)
    sidecar_of(cache.root / KEY.file_name()).write_bytes(
        sidecar_of(cache.root / other.file_name()).read_bytes())
    later_process(monkeypatch)
    said = io.StringIO()
    PackageCache(tmp_path, progress=said).load_or_build(KEY, write_package)
    assert "its sidecar names another key" in rebuild_lines(said)[0]


def test_the_weights_are_kept_once_beside_the_packages_and_checked(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch) -> None:
    """A package's constants are stored as blobs named by their digest: two keys holding the
    same weights share one blob (views of one storage included), a later process runs each
    key on the blob's bytes, and a damaged blob makes the key that meets it rebuild (which
    writes the blob again)."""
    weight, packed = torch.arange(12.0).reshape(3, 4), torch.ones(2, 5, dtype=torch.float64)
    decode, verify = KEY, replace(KEY, label="verify-n4-b1-kv256")
    cache = PackageCache(tmp_path)
    cache.load_or_build(decode, with_constants({"model.w": weight, "constant1": packed,
                                                "constant1_0": packed[1:, 2:]}))
    cache.load_or_build(verify, with_constants({"model.w": weight.t()}))  # a view: same storage
    blobs = sorted((cache.root / "weights").iterdir())
    assert len(blobs) == 2  # weight's storage and packed's, each once

    later_process(monkeypatch)
    later = PackageCache(tmp_path)
    got = later.load_or_build(verify, not_again).run([])
    torch.testing.assert_close(got, [weight.t()], rtol=0, atol=0)
    got = later.load_or_build(decode, not_again).run([])
    torch.testing.assert_close(got, [packed, packed[1:, 2:], weight], rtol=0, atol=0)

    blob = next(b for b in blobs if b.stat().st_size == packed.nbytes)
    blob.write_bytes(b"\0" * packed.nbytes)
    later_process(monkeypatch)
    said = io.StringIO()
    rebuilt = PackageCache(tmp_path, progress=said)
    out = rebuilt.load_or_build(decode, with_constants({"model.w": weight, "constant1": packed}))
    torch.testing.assert_close(out.run([]), [packed, weight], rtol=0, atol=0)
    assert len(rebuilt.builds) == 1 and f"weights blob {blob.name[:12]} is corrupt" in \
        rebuild_lines(said)[0]


# --- a package that crashed a process ------------------------------------------------------

CHILD = """
import json, os, sys
from pathlib import Path
from refengine.graph import aot_format, aot_store

class Crashes:
    def run(self, inputs):
        os._exit(70)  # as a segfault ends it: no finally, no atexit

def open_package(path):
    if sys.argv[2] == "load":
        os._exit(70)
    return Crashes()

def build(path):
    path.write_bytes(b"package")

aot_store.open_package = open_package
key = aot_format.ArtefactKey(**json.loads(sys.argv[3]))
package = aot_store.PackageCache(Path(sys.argv[1]), progress=None).load_or_build(key, build)
package.run([])
"""


@pytest.mark.parametrize("phase", ["load", "first call"])
def test_a_package_that_killed_its_process_is_rebuilt_by_the_next(
        tmp_path: Path, opened: list[Runner], phase: str) -> None:
    """A child process builds the key, then dies inside the loader or inside the package's
    first call, leaving its loading marker; the next process finds the marker's process dead,
    deletes the package and rebuilds it, in one line."""
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), phase,
                            json.dumps(asdict(KEY))], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert child.returncode == 70, child.stderr
    cache = PackageCache(tmp_path, progress=(said := io.StringIO()))
    [marker] = cache.markers()
    assert marker.pid != os.getpid() and not marker.alive
    cache.load_or_build(KEY, write_package).run([])
    assert len(cache.builds) == 1 and not cache.markers()
    [line] = rebuild_lines(said)
    assert f"crashed a process (pid {marker.pid})" in line


def test_a_package_loaded_and_called_leaves_no_marker(tmp_path: Path,
                                                      opened: list[Runner]) -> None:
    """The marker lasts from before the load to the end of the first call; a process that
    ends without calling a package it loaded removes its marker at exit (``atexit``)."""
    cache = PackageCache(tmp_path)
    package = cache.load_or_build(KEY, write_package)
    [marker] = cache.markers()
    assert marker.pid == os.getpid() and marker.alive
    package.run([])
    assert not cache.markers()
    cache.load_or_build(replace(KEY, threads=8), write_package)
    assert len(cache.markers()) == 1
    aot_process.unmark_pending()  # what the process's exit runs
    assert not cache.markers()


def test_a_marker_of_a_running_process_is_left_alone(tmp_path: Path,
                                                     opened: list[Runner]) -> None:
    """Another process between loading a package and its first call: not a crash."""
    cache = PackageCache(tmp_path)
    cache.load_or_build(KEY, write_package)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        try:
            marker = cache.root / "loading" / f"{KEY.file_name()}.{other.pid}"
            marker.write_text(json.dumps({"pid": other.pid, "host": os.uname().nodename,
                                          "started": aot_process.process_start(other.pid)}))
            aot_process.LOADED.clear()
            cache.load_or_build(KEY, not_again)
            assert marker.exists()
        finally:
            other.kill()


def test_a_process_that_ended_is_dead_even_unreaped() -> None:
    """A crashed worker its parent has not waited for yet (a zombie) no longer runs."""
    host = os.uname().nodename
    with subprocess.Popen([sys.executable, "-c", "pass"]) as ended:
        deadline = time.monotonic() + 60
        while (aot_process.proc_stat(ended.pid) or ["Z"])[0] != "Z" \
                and time.monotonic() < deadline:  # until it has ended, not waited for
            time.sleep(0.01)
        assert not aot_process.alive(ended.pid, host, None)
    assert aot_process.alive(os.getpid(), host, aot_process.process_start(os.getpid()))
    assert not aot_process.alive(os.getpid(), host, "a start time of another process")


# --- a cache this process cannot write -----------------------------------------------------

@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Make a directory tree read-only (chmod 0o555). Root with ``CAP_DAC_OVERRIDE`` ignores
    the permission bits, so there the writes the cache makes (``os.open`` for writing,
    ``mkdir``, ``replace``, ``unlink``, ``utime``) are refused under that tree as the kernel
    refuses them to anyone else; run as a user (or as root with the capability dropped,
    ``setpriv --bounding-set=-dac_override,-dac_read_search,-fowner``) the bits do it."""
    made: list[Path] = []

    def refuse(fn: Callable[..., Any], writes: Callable[..., bool]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if writes(*args, **kwargs) and any(
                    Path(p).absolute().is_relative_to(d) for d in made
                    for p in args[:2] if isinstance(p, (str, os.PathLike))):
                raise PermissionError(errno.EACCES, "Permission denied", str(args[0]))
            return fn(*args, **kwargs)
        return guarded

    def make(root: Path) -> None:
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
        made.append(root.absolute())
        try:
            (root / ".probe").write_bytes(b"")
        except PermissionError:
            return  # the bits hold
        (root / ".probe").unlink()
        if len(made) > 1:
            return
        flags_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        monkeypatch.setattr(os, "open", refuse(
            os.open, lambda path, flags, *a, **k: bool(flags & flags_write)))
        for name in ("mkdir", "replace", "rename", "unlink", "utime", "rmdir"):
            monkeypatch.setattr(os, name, refuse(getattr(os, name), lambda *a, **k: True))

    yield make
    monkeypatch.undo()
    for root in made:
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o755)


def test_a_read_only_cache_loads_a_valid_package_without_a_lock(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch,
        read_only: Callable[[Path], None]) -> None:
    PackageCache(tmp_path).load_or_build(KEY, write_package)
    before = sorted(p.name for p in (tmp_path / "aot").iterdir())
    (tmp_path / "aot" / f".lock-{KEY.file_name()}").unlink()
    before.remove(f".lock-{KEY.file_name()}")
    read_only(tmp_path / "aot")
    later_process(monkeypatch)
    cache = PackageCache(tmp_path)
    package = cache.load_or_build(KEY, not_again)
    package.run([])
    assert sorted(p.name for p in cache.root.iterdir()) == before  # no lock, nothing written


class PlusOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + 1,)


def test_a_read_only_cache_runs_what_it_cannot_build_in_memory_with_one_warning(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch,
        read_only: Callable[[Path], None]) -> None:
    """A key with no package, and a damaged one that cannot be deleted: each runs compiled in
    this process (as a ``CompiledKey``), the two together said in one warning line, no
    traceback."""
    monkeypatch.setattr(aot, "FALLBACK_BACKEND", "eager")  # dynamo only: no code generated
    cache = PackageCache(tmp_path, progress=(said := io.StringIO()))
    cache.root.mkdir(parents=True)
    packages = AotPackages(PlusOne(), cache)
    damaged = packages.artefact_key("damaged", [torch.zeros(2)], [None], 1)
    (cache.root / damaged.file_name()).write_bytes(b"pockage")
    read_only(cache.root)
    for label in ("plus-one", "damaged"):
        packages.load(label, label, PlusOne, [torch.zeros(2)], rows=1)
        [got] = packages.run(label, [torch.zeros(2)])
        torch.testing.assert_close(got, torch.ones(2))
        assert isinstance(packages._loaded[label], CompiledKey)
    [line] = said.getvalue().splitlines()
    assert line.startswith("specgate: warning: cannot build plus-one: the cache directory ")
    assert "is not writable (Permission denied)" in line and "compiled in memory" in line
    assert not opened and not cache.builds


def test_too_little_free_space_runs_the_key_in_memory_with_one_warning(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage(NamedTuple):
        total: int
        used: int
        free: int

    monkeypatch.setattr(aot_store.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 10**6))
    cache = PackageCache(tmp_path, progress=(said := io.StringIO()))
    with pytest.raises(CannotBuild, match=r"only 0\.00 GB free on the disk of .* needs 0\.27"):
        cache.load_or_build(KEY, lambda path: pytest.fail("built on a full disk"))
    monkeypatch.setattr(aot, "FALLBACK_BACKEND", "eager")
    packages = AotPackages(PlusOne(), cache)
    for label in ("a", "b"):
        packages.load(label, label, PlusOne, [torch.zeros(2)], rows=1)
        torch.testing.assert_close(packages.run(label, [torch.zeros(2)])[0], torch.ones(2))
    [line] = said.getvalue().splitlines()
    assert line.startswith("specgate: warning: cannot build a: only 0.00 GB free")
    assert not cache.entries()


# --- the budget ----------------------------------------------------------------------------

def test_past_the_budget_the_least_recently_used_are_evicted(
        tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch) -> None:
    """After a build the cache keeps to its budget: oldest use first, skipping every package
    this process loaded (and the one just built), one line."""
    keys = [replace(KEY, label=f"k{i}") for i in range(4)]
    cache = PackageCache(tmp_path, progress=None)
    for i, key in enumerate(keys[:3]):
        cache.load_or_build(key, write_package)
        os.utime(sidecar_of(cache.root / key.file_name()), (1000 + i, 1000 + i))  # k0 oldest
    entry = cache.info().packages[0].size
    later_process(monkeypatch)  # a later process, which uses k0 only
    cache = PackageCache(tmp_path, progress=(said := io.StringIO()))
    cache.load_or_build(keys[0], not_again)
    cache.budget = 2 * entry + entry // 2  # room for two packages
    cache.load_or_build(keys[3], write_package)
    assert [p.name for p in cache.entries()] == sorted(k.file_name() for k in (keys[0], keys[3]))
    [line] = [s for s in said.getvalue().splitlines() if s.startswith("specgate: cache over")]
    assert "evicted 2 least recently used package(s)" in line


def test_the_budget_setting_is_checked(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(aot_format.BUDGET_ENV, raising=False)
    assert budget_bytes() == 4 * 10**9
    monkeypatch.setenv(aot_format.BUDGET_ENV, "0.5")
    assert budget_bytes() == 5 * 10**8
    for bad in ("lots", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(aot_format.BUDGET_ENV, bad)
        with pytest.raises(CacheConfigError, match=r"SPECGATE_CACHE_MAX_GB must be a positive"):
            PackageCache()
    assert main(["cache", "info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"got {bad!r}" in err


# --- prune, info, clear --------------------------------------------------------------------

def dead_pid() -> int:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(ended.stdout)


def test_prune_removes_what_this_code_can_never_load(tmp_path: Path, opened: list[Runner],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PackageCache(tmp_path, progress=None)
    cache.blob_grace_s = 0
    current, old_code, old_torch, crashed, bare = (
        replace(KEY, label=name) for name in ("current", "old-code", "old-torch", "crashed",
                                              "bare"))
    weight = torch.arange(4.0)
    cache.load_or_build(current, with_constants({"w": weight}), sources="s1")
    cache.load_or_build(old_code, with_constants({"w": weight * 2}), sources="s0")
    cache.load_or_build(replace(old_torch, torch="2.12.0"), write_package, sources="s1")
    cache.load_or_build(crashed, write_package, sources="s1")
    (cache.root / bare.file_name()).write_bytes(b"package")  # a package of before sidecars
    pid = dead_pid()
    (cache.root / "loading" / f"{crashed.file_name()}.{pid}").write_text(
        json.dumps({"pid": pid, "host": os.uname().nodename, "started": None}))
    (cache.root / f".tmp-{pid}-x-{KEY.file_name()}").write_bytes(b"half")
    later_process(monkeypatch)
    pruner = PackageCache(tmp_path)
    pruner.blob_grace_s = 0
    pruned = pruner.prune("s1", "2.13.0")
    assert sorted(pruned.packages) == sorted(
        k.file_name() for k in (old_code, replace(old_torch, torch="2.12.0"), crashed, bare))
    assert [p.name for p in cache.entries()] == [current.file_name()]
    assert len(list((cache.root / "weights").iterdir())) == 1  # old-code's blob collected
    assert not cache.temporaries() and all(m.alive for m in cache.markers())


def test_info_and_clear(tmp_path: Path, opened: list[Runner], monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(aot_format.BUDGET_ENV, "2.5")
    cache = PackageCache()
    cache.load_or_build(KEY, with_constants({"w": torch.zeros(256)}))
    pid = dead_pid()
    (cache.root / f".tmp-{pid}-x-{KEY.file_name()}").write_bytes(b"\0" * 3 * 2**20)
    (cache.root / "loading" / f"{KEY.file_name()}.{pid}").write_text(
        json.dumps({"pid": pid, "host": os.uname().nodename, "started": None}))
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "1 package(s)" in out and "1 shared weight blob(s), 0.0 MiB" in out
    assert "of a 2.50 GB budget ($SPECGATE_CACHE_MAX_GB)" in out
    assert f"  {KEY.file_name()}  0.0 MiB  last used " in out
    assert f".tmp-{pid}-x-{KEY.file_name()}  3.0 MiB  left by a killed build" in out
    assert f"{KEY.file_name()}.{pid}  pid {pid}, dead" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 package(s)" in capsys.readouterr().out
    assert list(cache.root.iterdir()) == []
