"""Persistent compiled keys (``refengine/graph/aot.py``): the artefact's name covers everything
that changes it, a build lands whole or not at all, a file that does not load is rebuilt, never
used, and ``specgate cache info|clear`` shows and empties the cache. The slow test compiles a
real key and loads it in a second executor without compiling, its weights kept once beside the
package. What the cache does with damaged, crashed, unwritable or over-budget packages:
``test_aot_cache_integrity.py``."""

from __future__ import annotations

import io
import re
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from conformance.cli import main
from refengine.graph import aot, aot_process, aot_store
from refengine.graph.aot import (
    AotPackages,
    code_digest,
    package_settings,
    signature,
    weights_digest,
)
from refengine.graph.aot_format import SHARED_WEIGHTS, ArtefactKey, cache_dir
from refengine.graph.aot_store import PackageCache
from refengine.graph.compile import FROZEN_WEIGHTS
from refengine.graph.export import open_limits, register_tables
from refengine.model.llama import Rotary

KEY = ArtefactKey("decode-b1-kv256", "w" * 64, "torch.int64[1]@cpu", "{}", "2.13.0", "AVX2", 2,
                  "c" * 64)


@pytest.fixture
def fake_packages(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``open_package`` that loads a file holding b"package" and fails on anything else,
    as the real one fails on a truncated or corrupt package; -> the paths it loaded."""
    loaded: list[str] = []

    def load(path: str) -> str:
        if Path(path).read_bytes() != b"package":
            raise RuntimeError(f"not a package: {path}")
        loaded.append(path)
        return path

    monkeypatch.setattr(aot_store, "open_package", load)
    for state in ("LOADED", "BLOBS", "PENDING", "WARNED"):  # as a fresh process's
        monkeypatch.setattr(aot_process, state, type(getattr(aot_process, state))())
    return loaded


def write_package(path: Path) -> None:
    path.write_bytes(b"package")


def test_the_file_name_covers_every_field() -> None:
    names = {KEY.file_name()}
    for f in fields(ArtefactKey):
        value = getattr(KEY, f.name)
        changed = value + 1 if isinstance(value, int) else value + "x"
        names.add(replace(KEY, **{f.name: changed}).file_name())
    assert len(names) == 1 + len(fields(ArtefactKey))
    assert KEY.file_name().startswith("decode-b1-kv256-")


def test_built_once_then_loaded(tmp_path: Path, fake_packages: list[str]) -> None:
    cache = PackageCache(tmp_path)
    first = cache.load_or_build(KEY, write_package)
    same_process = PackageCache(tmp_path)  # another engine: the package loaded already
    assert same_process.load_or_build(KEY, write_package) is first and len(fake_packages) == 1
    aot_process.LOADED.clear()  # a later process
    again = PackageCache(tmp_path)
    again.load_or_build(KEY, lambda p: pytest.fail("a cached key was built again"))
    assert (len(cache.builds), len(again.builds)) == (1, 0) and len(fake_packages) == 2
    assert [p.name for p in cache.entries()] == [KEY.file_name()]


def test_each_build_says_which_key_and_how_long(tmp_path: Path,
                                                fake_packages: list[str]) -> None:
    said = io.StringIO()
    cache = PackageCache(tmp_path, progress=said)
    cache.load_or_build(KEY, write_package)
    PackageCache(tmp_path, progress=said).load_or_build(KEY, write_package)  # loads: silent
    lines = said.getvalue().splitlines()
    assert len(lines) == 2 and "compiling decode-b1-kv256" in lines[0]
    assert re.search(r"compiled decode-b1-kv256 in \d+\.\d s \(1 this run", lines[1]), lines
    assert [b.label for b in cache.builds] == ["decode-b1-kv256"]


def test_what_a_package_runs_on_is_part_of_its_key() -> None:
    """The inputs' shapes (a verify width, a dtype) and the rotary tables (plain tensors beside
    the weights, set by the model's config) each change the artefact's name; the pool's and
    the row table's sizes, which follow an engine's limits, do not."""
    assert signature([torch.zeros(2, 4)]) != signature([torch.zeros(2, 8)])
    assert signature([torch.zeros(2)]) != signature([torch.zeros(2, dtype=torch.int64)])
    pool, table = open_limits()  # what an engine's limits set is left free
    assert signature([torch.zeros(2, 4), torch.zeros(3, 300)], [pool, table]) \
        == signature([torch.zeros(2, 8), torch.zeros(5, 300)], [pool, table])
    digests = set()
    for theta in (10_000.0, 500_000.0):
        holder = torch.nn.Module()
        register_tables(holder, Rotary(8, 16, theta))
        digests.add(weights_digest(holder))
    assert len(digests) == 2


def test_the_gemm_kernels_follow_the_rows_a_key_multiplies() -> None:
    """Few rows: the frozen executor's C++ GEMM templates; from ``MANY_ROWS`` on: ATen's GEMM,
    weights folded in either way. The choice is part of the artefact's name, so a package
    built one way is never loaded for the other."""
    few, many = package_settings(aot.MANY_ROWS - 1), package_settings(aot.MANY_ROWS)
    assert few == {**FROZEN_WEIGHTS, **SHARED_WEIGHTS}
    assert many["freezing"] and "max_autotune_gemm_backends" not in many
    packages = AotPackages(torch.nn.Module(), PackageCache(progress=None))
    names = {packages.artefact_key("verify-b8", [torch.zeros(2)], [None], rows).file_name()
             for rows in (1, aot.MANY_ROWS - 1, aot.MANY_ROWS, 640)}
    assert len(names) == 2


class PlusOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class PlusTwo(PlusOne):  # a subclass that changes the forward, as a mutant or a backend would
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 2


def test_a_subclass_that_changes_a_forward_has_packages_of_its_own() -> None:
    def holding(inner: torch.nn.Module) -> torch.nn.Module:
        outer = torch.nn.Module()
        outer.inner = inner
        return outer

    assert code_digest(holding(PlusOne())) == code_digest(holding(PlusOne()))
    assert code_digest(holding(PlusOne())) != code_digest(holding(PlusTwo()))


def test_an_interrupt_inside_a_package_call_stays_an_interrupt() -> None:
    """Ctrl-C landing in the KV write a package calls back comes out of the package's C++ as
    a RuntimeError; the caller gets the KeyboardInterrupt (exit 130, not a failed check)."""
    raised: list[Exception] = [RuntimeError("KeyboardInterrupt: <EMPTY MESSAGE>"),
                               RuntimeError("shape mismatch")]

    class Runner:
        def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            raise raised.pop(0)

    packages = AotPackages(torch.nn.Module(), PackageCache(progress=None))
    packages._loaded["key"] = Runner()
    with pytest.raises(KeyboardInterrupt):
        packages.run("key", [])
    with pytest.raises(RuntimeError, match="shape mismatch"):
        packages.run("key", [])


def test_a_failed_build_leaves_nothing(tmp_path: Path, fake_packages: list[str]) -> None:
    def half_then_fail(path: Path) -> None:
        path.write_bytes(b"pack")
        raise RuntimeError("compiler died")

    cache = PackageCache(tmp_path)
    with pytest.raises(RuntimeError, match="compiler died"):
        cache.load_or_build(KEY, half_then_fail)
    assert [p.name for p in cache.root.iterdir()] == [f".lock-{KEY.file_name()}"]
    assert not aot_process.PENDING  # nothing was loaded, so nothing is marked as loading


def test_a_key_being_built_elsewhere_is_waited_for_then_loaded(
        tmp_path: Path, fake_packages: list[str]) -> None:
    """Two builders of one key at once (xdist workers): the second waits on the key's lock
    and loads what the first built instead of compiling it again."""
    building, order = threading.Event(), []

    def slow_build(path: Path) -> None:
        building.set()
        time.sleep(0.3)
        order.append("built")
        write_package(path)

    first = threading.Thread(target=PackageCache(tmp_path).load_or_build,
                             args=(KEY, slow_build))
    first.start()
    building.wait()
    second = PackageCache(tmp_path)  # its own open of the lock file, as another process's
    second.load_or_build(KEY, lambda p: pytest.fail("built twice"))
    order.append("loaded")
    first.join()
    assert order == ["built", "loaded"] and not second.builds


def test_a_package_without_a_sidecar_is_rebuilt_never_used(tmp_path: Path,
                                                            fake_packages: list[str]) -> None:
    """A truncated file, or a package of a cache from before sidecars: no digest says what it
    should hold, so it is rebuilt."""
    said = io.StringIO()
    cache = PackageCache(tmp_path, progress=said)
    cache.root.mkdir(parents=True)
    (cache.root / KEY.file_name()).write_bytes(b"trunc")
    cache.load_or_build(KEY, write_package)
    assert len(cache.builds) == 1 and (cache.root / KEY.file_name()).read_bytes() == b"package"
    assert "no sidecar" in said.getvalue().splitlines()[0] and not fake_packages[:-1]


def test_clear_and_the_cache_location(tmp_path: Path, fake_packages: list[str],
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))
    assert cache_dir() == tmp_path
    PackageCache().load_or_build(KEY, write_package)
    (PackageCache().root / ".tmp-1-left-by-a-killed-build.pt2").write_bytes(b"")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'aot'}" in out and KEY.file_name() in out
    assert "left by a killed build" not in out  # pid 1 still runs: its build may be under way
    assert main(["cache", "clear"]) == 0
    assert "removed 1 package(s)" in capsys.readouterr().out
    assert list(PackageCache().root.iterdir()) == []
    monkeypatch.delenv(aot.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specgate"


@pytest.mark.slow
def test_a_compiled_key_loads_in_a_later_executor_without_compiling(tmp_path: Path) -> None:
    """A real key: the package's forward is the eager forward's (logits and the KV it writes),
    and a second executor (a later process) loads it from the cache."""
    from refengine import Engine, EngineConfig
    from refengine.graph.aot import AotExecutor
    from refengine.graph.target import GraphKey

    engine = Engine(EngineConfig(cuda_graph=True, graph_executor="replay",
                                 max_running_requests=1))
    runner = engine.runner
    kv = runner.kv.target_pool
    key = GraphKey("decode", 1, 256)
    views = runner.staging["decode"].stage(None, 1)
    with torch.inference_mode():
        want = runner.program.run(key, views)
    written = kv.k[:, 0].clone()  # the padding row's K, in the dummy slot
    kv.k[:, 0] = 0.0
    first = AotExecutor(runner.program, PackageCache(tmp_path))
    got = first.run(key, views)
    assert len(first.packages.cache.builds) == 1
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv.k[:, 0], written, atol=1e-4, rtol=1e-4)
    package = first.packages.cache.entries()[0]
    blobs = sorted((first.packages.cache.root / "weights").iterdir())
    assert package.stat().st_size < sum(b.stat().st_size for b in blobs)  # code, not weights
    aot_process.LOADED.clear()  # a later process: it loads the package from disk
    aot_process.BLOBS.clear()
    later = AotExecutor(runner.program, PackageCache(tmp_path))
    start = time.perf_counter()
    torch.testing.assert_close(later.run(key, views).logits, got.logits)
    assert not later.packages.cache.builds and time.perf_counter() - start < 2.0
