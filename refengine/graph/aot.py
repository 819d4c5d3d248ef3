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
gives a different name, so a stale artefact is never found; one that fails to load (a
truncated write, a corrupt file) is deleted and rebuilt. A build writes to a private temporary
file and renames it into place, so no reader ever sees half a package, and holds a lock file
per key, so processes that need the same key at once (xdist workers) build it once. The
cache lives in ``$SPECGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/specgate``
(``~/.cache/specgate``); ``specgate cache info|clear`` shows and empties it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import os
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from refengine.graph.compile import FROZEN_WEIGHTS
from refengine.graph.executors import GraphKey, whole_forward
from refengine.graph.staging import StagedViews
from refengine.memory.kv_pool import KVPool
from refengine.model.llama import ForwardOutput, LlamaForCausalLM, Rotary

CACHE_ENV = "SPECGATE_CACHE_DIR"
# A package's GEMMs: inductor's C++ templates (``FROZEN_WEIGHTS``) beat ATen's GEMM on the same
# packed weights when a forward has few rows, and lose to it by far when it has many (a verify
# key of a large bucket): a key whose forwards multiply at least this many rows gets ATen's.
# The crossover was measured on this project's CPU (docs/measurements.md).
MANY_ROWS = 32
_ATEN_GEMMS = {"freezing": True}
_REFENGINE = Path(__file__).resolve().parents[1]
# The code a compiled forward is made of: a change in any of these changes every artefact.
# Not this file: its cache and loader are not in a package, and the export wrappers it defines
# are in the digest as classes (``code_digest``), so fixing the loader keeps the packages.
_FORWARD_SOURCES = ("model/llama.py", "model/attention.py", "model/eagle.py",
                    "model/frozen_kv_mtp.py", "graph/executors.py", "graph/staging.py",
                    "graph/compile.py", "graph/draft_loop.py", "speculative/draft_search.py")


def package_settings(rows: int) -> dict[str, Any]:
    """Inductor's settings for a key whose forwards multiply ``rows`` rows per GEMM (requests
    times tokens per request): weights folded in either way, the GEMM kernels ``MANY_ROWS``
    picks."""
    return dict(FROZEN_WEIGHTS if rows < MANY_ROWS else _ATEN_GEMMS)


def cache_dir() -> Path:
    """Where packages are kept: ``$SPECGATE_CACHE_DIR``, else the platform's user cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgate"


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


Dims = dict[int, torch.export.Dim]  # an input's dimensions that a package leaves free


def open_limits() -> tuple[Dims, Dims]:
    """The free dimensions of the KV pool (its slots) and of the row table (its rows): they
    follow the limits an engine opens with (pool tokens, requests), not the shapes a key
    computes on, so engines opened with other limits share the package. The table's width
    stays fixed: a key at the widest width reads the whole row, a narrower one a prefix, and
    export compiles the two differently."""
    return {1: torch.export.Dim("slots", min=2)}, {0: torch.export.Dim("rows", min=2)}


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


# Packages this process has loaded, by file: every engine on the same weights and key shares
# one (a package is called with the engine's own pool and buffers, and holds nothing else that
# a call changes), so a run that opens many engines loads each package once.
_LOADED: dict[Path, Any] = {}


def open_package(path: str) -> Any:
    """A package's runner (``.run(inputs) -> outputs``), from torch's C++ loader directly:
    ``aoti_load_package`` would import inductor and try a newer archive format first, about
    2.4 s at a process's first load against 0.02 s. A torch without that loader (or with
    another signature) gets the public path."""
    try:
        return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    except (AttributeError, TypeError):
        return torch._inductor.aoti_load_package(path).loader


def _load(path: Path) -> Any:
    _LOADED[path] = open_package(str(path))
    return _LOADED[path]


@dataclass(frozen=True)
class Build:
    """One package compiled by this process: which key, in how many seconds."""

    label: str
    seconds: float


class PackageCache:
    """Compiled packages on disk, one file per ``ArtefactKey``."""

    def __init__(self, root: Path | None = None, progress: TextIO | None = sys.stderr) -> None:
        """``progress``: where each build says which key it compiles and how long it took
        (a first run on a machine compiles for minutes); None: silent."""
        self.root = (root or cache_dir()) / "aot"
        self.progress = progress
        self.builds: list[Build] = []  # the packages this instance compiled (the rest it loaded)

    def load_or_build(self, key: ArtefactKey, build: Callable[[Path], None]) -> Any:
        """The loaded package of ``key``: loaded already by this process, from the cache, or
        built by ``build(path)`` (which writes a package at ``path``) and stored first. A
        file that fails to load is deleted and rebuilt."""
        path = self.root / key.file_name()
        if path in _LOADED:
            return _LOADED[path]
        self.root.mkdir(parents=True, exist_ok=True)
        # One build per key at a time on the machine: a process that finds another building
        # it (an xdist worker beside this one) waits, then loads what that one built.
        with open(path.with_name(f".lock-{path.name}"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                try:
                    return _load(path)
                except Exception:  # any failure to load means: not usable
                    path.unlink(missing_ok=True)
            return self._build(key, path, build)

    def _build(self, key: ArtefactKey, path: Path, build: Callable[[Path], None]) -> Any:
        # private to this build, and still a ".pt2" (the packager insists on the suffix)
        temporary = path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}-{path.name}")
        self._say(f"specgate: compiling {key.label} (once per machine, into {self.root})")
        start = time.perf_counter()
        try:
            build(temporary)
            os.replace(temporary, path)  # atomic: a reader sees no package or a whole one
        finally:
            temporary.unlink(missing_ok=True)
        self.builds.append(Build(key.label, time.perf_counter() - start))
        self._say(f"specgate: compiled {key.label} in {self.builds[-1].seconds:.1f} s "
                  f"({len(self.builds)} this run, "
                  f"{sum(b.seconds for b in self.builds):.0f} s in all)")
        return _load(path)

    def _say(self, line: str) -> None:
        if self.progress is not None:
            print(line, file=self.progress, flush=True)

    def entries(self) -> list[Path]:
        """The packages (not the temporaries of builds under way or killed)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.pt2") if not p.name.startswith("."))

    def clear(self) -> int:
        """Delete every package, any temporary a killed build left and the lock files;
        -> packages deleted."""
        removed = 0
        if self.root.is_dir():
            for p in [*self.root.glob("*.pt2"), *self.root.glob(".lock-*")]:
                p.unlink(missing_ok=True)
                removed += p.suffix == ".pt2" and not p.name.startswith(".")
        return removed


def register_tables(module: torch.nn.Module, rotary: Rotary) -> None:
    """The rotary tables (plain tensors, not module state) as ``module``'s buffers, so the
    weights digest of what a package exports covers them (they follow the model's config)."""
    module.register_buffer("rotary_cos", rotary.cos, persistent=False)
    module.register_buffer("rotary_sin", rotary.sin, persistent=False)


class _KeyForward(torch.nn.Module):
    """The graph runner's whole forward at one key width, as a module to export (its weights
    are the model's; the pools, staged views and row table are its inputs)."""

    def __init__(self, model: LlamaForCausalLM, max_kv: int) -> None:
        super().__init__()
        self.model, self.max_kv = model, max_kv
        register_tables(self, model.rotary)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs``: the pools, the staged views and the row table, in ``whole_forward``'s
        order."""
        return whole_forward(self.model, *inputs, self.max_kv)


class AotPackages:
    """Loaded packages by key, for one module's forward (the target's, or a draft loop's):
    ``load(key, label, module, inputs)`` loads the key's package, building it first if this
    machine has none (``module`` exported on ``inputs``); ``run(key, inputs)`` calls it
    directly, with no tracing, guards or Python wrapper around the compiled code."""

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

        def build(path: Path) -> None:
            with torch.no_grad():  # one entry per parameter, and ``*inputs`` is one
                program = torch.export.export(module().eval(), tuple(inputs), strict=False,
                                              dynamic_shapes=(free,))
            with warnings.catch_warnings():  # torch's own pytree deprecation, once per build
                warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
                torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                         inductor_configs=package_settings(rows))

        self._loaded[key] = self.cache.load_or_build(artefact, build)

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


class AotExecutor:
    """The target's decode and verify keys as persistent AOTInductor packages (module
    docstring); each loaded package is called directly with the staged views."""

    name = "aot"
    outputs_persist = False  # a package allocates its outputs per call

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, table: torch.Tensor,
                 cache: PackageCache | None = None) -> None:
        self.model, self.kv, self.table = model, kv, table
        self.packages = AotPackages(_KeyForward(model, 0), cache)

    def _inputs(self, views: StagedViews) -> list[torch.Tensor]:
        return [self.kv.k, self.kv.v, views.input_ids, views.positions, views.out_slots,
                views.rows, views.seq_lens, views.tree_mask, self.table]

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        pool, table = open_limits()
        tokens = f"-n{views.q}" if views.q > 1 else ""  # a verify key's tokens per request
        self.packages.load(key, f"{key.kind}{tokens}-b{key.bucket}-kv{key.max_kv}",
                           lambda: _KeyForward(self.model, key.max_kv), self._inputs(views),
                           key.bucket * views.q, [pool, pool, *[None] * 6, table])

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        self.prepare(key, views)
        logits, features = self.packages.run(key, self._inputs(views))
        return ForwardOutput(logits, features)
