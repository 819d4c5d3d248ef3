"""Persistent compiled keys: the "aot" executor exports each key's forward (the target's
decode and verify, the draft loops) once per machine, compiles it ahead of time into an
AOTInductor package (weights folded in; GEMM kernels by the rows the key multiplies,
``package_settings``) and stores it in a cache directory; later processes load the package (a
fraction of a second) and call it without Dynamo's tracing, guards or wrappers. Each build
says which key it compiles and how long it took (minutes in all, the first time a lane runs on
a machine).

An artefact's name is a digest of everything that changes it (``ArtefactKey``): the weights,
the key's constants and input shapes, the compile settings, torch's version, the CPU's
instruction set, the thread count and the source of the code the forward runs. The sizes that
follow an engine's limits (the pool's slots, the row table's rows) are left free in the package
(``open_limits``), so engines opened with other limits share it. A different model or torch
gives a different name, so a stale artefact is never found.

The cache itself is ``aot_store.py`` (its files ``aot_format.py``, what it holds and trims
``aot_index.py``, this process's part ``aot_process.py``): a package holds only code, its
constants (folded and packed weights) are stored once per machine by content and shared by
every package of the model; each package's bytes are checked against a digest recorded at
build time, a package that crashed a process is rebuilt, a key that cannot be built there (a
read-only cache, a full disk) runs compiled in memory (``CompiledKey``) with one warning, and
the cache keeps to a size budget. It lives in ``$SPECGATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/specgate`` (``~/.cache/specgate``); ``specgate cache info|prune|clear``
shows, trims and empties it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic
from unittest import mock

import torch

from refengine.graph.aot_format import CACHE_ENV as CACHE_ENV  # re-exported: callers, tests
from refengine.graph.aot_format import (
    SHARED_WEIGHTS,
    ArtefactKey,
    CannotBuild,
    Constants,
)
from refengine.graph.aot_format import cache_dir as cache_dir
from refengine.graph.aot_format import open_package as open_package
from refengine.graph.aot_store import PackageCache
from refengine.graph.compile import FROZEN_WEIGHTS
from refengine.graph.compiled import CompiledKey
from refengine.graph.export import Dims
from refengine.graph.program import K2, R2, V2, Executor, K, Program, R, V

# A package's GEMMs: inductor's C++ templates (``FROZEN_WEIGHTS``) beat ATen's GEMM on the same
# packed weights when a forward has few rows, and lose to it by far when it has many (a verify
# key of a large bucket): a key whose forwards multiply at least this many rows gets ATen's.
# The crossover was measured on this project's CPU (docs/measurements.md).
MANY_ROWS = 32
_ATEN_GEMMS = {"freezing": True}
_REFENGINE = Path(__file__).resolve().parents[1]
# What a key that cannot be built is compiled with in memory (tests: "eager", no code made).
FALLBACK_BACKEND = "inductor"
# The code a compiled forward is made of: a change in any of these changes every artefact.
# Not this file: its cache and loader are not in a package, so fixing the loader keeps the
# packages.
_FORWARD_SOURCES = ("model/llama.py", "model/attention.py", "model/eagle.py",
                    "model/frozen_kv_mtp.py", "graph/target.py", "graph/staging.py",
                    "graph/compile.py", "graph/loops.py", "speculative/draft_search.py")


def package_settings(rows: int) -> dict[str, Any]:
    """Inductor's settings for a key whose forwards multiply ``rows`` rows per GEMM (requests
    times tokens per request): weights folded in either way, the GEMM kernels ``MANY_ROWS``
    picks, the constants kept out of the package's code (``SHARED_WEIGHTS``)."""
    return {**(FROZEN_WEIGHTS if rows < MANY_ROWS else _ATEN_GEMMS), **SHARED_WEIGHTS}


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def signature(inputs: Sequence[torch.Tensor], free: Sequence[Dims | None] = ()) -> str:
    """Every input's dtype, shape (a free dimension by its name) and device: a package runs
    on exactly these. ``free``: per input, its free dimensions (missing at the end: none)."""
    def dims(t: torch.Tensor, names: Dims | None) -> list[int | str]:
        names = names or {}
        return [names[d].__name__ if d in names else n for d, n in enumerate(t.shape)]

    return ";".join(f"{t.dtype}{dims(t, names)}@{t.device}"
                    for t, names in zip(inputs, per_input(inputs, free), strict=True))


def per_input(inputs: Sequence[torch.Tensor], free: Sequence[Dims | None]
              ) -> tuple[Dims | None, ...]:
    """``free`` with an entry for every input (missing ones at the end: no free dimension)."""
    return tuple(free) + (None,) * (len(inputs) - len(free))


@functools.cache
def sources_digest() -> str:
    """The engine's forward code, file by file."""
    h = hashlib.sha256()
    for rel in _FORWARD_SOURCES:
        h.update((_REFENGINE / rel).read_bytes())
    return h.hexdigest()


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # defined where no source is kept: its name must do
        return ""


def code_digest(module: torch.nn.Module) -> str:
    """The code a package of ``module`` is made of: the engine's forward sources, and the name
    and source of every module class it holds, so a subclass that changes a forward (a
    backend's own model, a mutant) gets packages of its own, never the base class's."""
    h = hashlib.sha256(sources_digest().encode())
    for cls in sorted({type(m) for m in module.modules()}, key=lambda c: c.__qualname__):
        h.update(f"{cls.__module__}.{cls.__qualname__}\n{_class_source(cls)}".encode())
    return h.hexdigest()


# The settings of a package that keeps its constants in its code (``supplies`` said no).
_CONSTANTS_INSIDE = {"aot_inductor.package_constants_in_so": True}


def _compile(program: torch.export.ExportedProgram, path: Path, settings: dict[str, Any]
             ) -> None:
    with warnings.catch_warnings():  # torch's own pytree deprecation, once per build
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=settings)


@contextlib.contextmanager
def captured_constants() -> Iterator[Constants]:
    """The constants of the package compiled inside (folded and packed weights, tables), by
    the names its code gives them, as inductor serialises them (``AotCodeCompiler.compile``).
    By name, not by the original names torch's own ``load_constants`` takes: a draft loop
    gets several differently packed constants of one original name (``constant10``,
    ``constant10_0``, ...), which that map cannot tell apart."""
    from torch._inductor import codecache

    captured: Constants = {}
    compile_package = codecache.AotCodeCompiler.compile

    def capturing(cls: type, graph: Any, *args: Any, **kwargs: Any) -> Any:
        folded = getattr(graph, "folded_constants", set())
        captured.update({name: graph.get_original_value_of_constant(name)
                         for name in graph.constants if name not in folded})
        return compile_package(graph, *args, **kwargs)

    with mock.patch.object(codecache.AotCodeCompiler, "compile", classmethod(capturing)):
        yield captured


def supplies(path: Path, constants: Constants) -> bool:
    """Whether ``constants`` are every constant the package at ``path`` takes, by name,
    dtype and shape (the loader refuses anything else), each a plain strided tensor (a blob
    holds bytes; an opaque oneDNN tensor cannot be rebuilt from them)."""
    if any(t.layout != torch.strided for t in constants.values()):
        return False
    try:
        open_package(str(path)).update_constant_buffer(constants, False, True, False)
    except Exception:  # any refusal means: not these
        return False
    return True


class AotPackages:
    """Loaded packages by key, for one module's forward (the target's, or a draft loop's):
    ``load(key, label, module, inputs)`` loads the key's package, building it first if this
    machine has none (``module`` exported on ``inputs``); ``run(key, inputs)`` calls it
    directly, with no tracing, guards or Python wrapper around the compiled code. A key this
    machine cannot build runs compiled in memory (a ``CompiledKey``), gone when the process
    ends."""

    def __init__(self, weights: torch.nn.Module, cache: PackageCache | None = None) -> None:
        """``weights``: the module a build exports, holding every tensor the packages fold in
        (the digests of its tensors and of its classes' code are part of every key)."""
        self.weights_of, self.cache = weights, cache or PackageCache()
        self._loaded: dict[Hashable, Any] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._loaded

    @functools.cached_property
    def _digests(self) -> tuple[str, str]:
        """(weights, code): hashing the weights is slow, so once per instance."""
        return weights_digest(self.weights_of), code_digest(self.weights_of)

    @functools.cached_property
    def _build_bytes(self) -> int:
        """What a build writes to the cache's disk, at most: the package as compiled holds the
        weights and their packed copies, and the blobs take as much again."""
        tensors = [*self.weights_of.parameters(), *self.weights_of.buffers()]
        return 4 * sum(t.numel() * t.element_size() for t in tensors)

    def artefact_key(self, label: str, inputs: Sequence[torch.Tensor],
                     free: Sequence[Dims | None], rows: int) -> ArtefactKey:
        weights, code = self._digests
        return ArtefactKey(label, weights, signature(inputs, free),
                           json.dumps(package_settings(rows), sort_keys=True), torch.__version__,
                           torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                           code)

    def load(self, key: Hashable, label: str, module: Callable[[], torch.nn.Module],
             inputs: Sequence[torch.Tensor], rows: int, free: Sequence[Dims | None] = ()
             ) -> None:
        """Have ``key``'s package loaded; ``module()`` makes what a build exports (its forward
        takes ``*inputs``), ``rows`` the rows its forwards multiply (``package_settings``),
        ``free`` the dimensions of each input the package leaves free."""
        if key in self._loaded:
            return
        free = per_input(inputs, free)
        artefact = self.artefact_key(label, inputs, free, rows)

        def build(path: Path) -> Constants | None:
            with torch.no_grad():  # one entry per parameter, and ``*inputs`` is one
                program = torch.export.export(module().eval(), tuple(inputs), strict=False,
                                              dynamic_shapes=(free,))
            settings = package_settings(rows)
            with captured_constants() as constants:
                _compile(program, path, settings)
            if supplies(path, constants):
                return constants
            # Constants the cache cannot keep (oneDNN's packed weights, which inductor makes
            # for some linear layers of many rows), or a torch that names them otherwise: the
            # package keeps them in its code, as before they were shared.
            _compile(program, path, {**settings, **_CONSTANTS_INSIDE})
            return None

        try:
            self._loaded[key] = self.cache.load_or_build(artefact, build, sources_digest(),
                                                         self._build_bytes)
        except CannotBuild as err:
            self.cache.fall_back(label, err)
            self._loaded[key] = CompiledKey(module(), key, FALLBACK_BACKEND)

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        try:
            with torch.inference_mode():
                return self._loaded[key].run(list(inputs))
        except RuntimeError as err:
            # A Ctrl-C met in Python code the package calls back (the KV write) leaves its
            # C++ as a RuntimeError naming it: raise it as the interrupt it is.
            if str(err).startswith("KeyboardInterrupt"):
                raise KeyboardInterrupt from err
            raise


class AotExecutor(Generic[K, V, R]):
    """Each key of ``program`` as a persistent AOTInductor package (module docstring), called
    directly with the staged views; its siblings (the draft loops') keep their packages in the
    same cache, so one engine reports its builds together."""

    name = "aot"
    outputs_persist = False  # a package allocates its outputs per call

    def __init__(self, program: Program[K, V, R], cache: PackageCache | None = None) -> None:
        self.program = program
        self.packages = AotPackages(program.weights(), cache)

    def prepare(self, key: K, views: V) -> None:
        """Load ``key`` (built first if needed) and call it once on ``views`` (padding only):
        a package is marked as loading until its first call returns, so a later process does
        not take a process ended meanwhile for its crash."""
        self.run(key, views)

    def run(self, key: K, views: V) -> R:
        inputs = self.program.inputs(views)
        if key not in self.packages:
            spec = self.program.package(key, views)
            self.packages.load(key, spec.label, lambda: self.program.module(key), inputs,
                               spec.rows, spec.free)
        return self.program.outputs(self.packages.run(key, inputs))

    def pending(self) -> list[K]:
        return []  # a key loads (or builds) wherever it is first needed

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        return AotExecutor(program, self.packages.cache)
