"""Persistent compiled keys: the "aot" executor exports each key's forward once per machine,
compiles it ahead of time into an AOTInductor package (weights folded in, the frozen
executor's settings) and stores it in a cache directory; later processes load the package
(a fraction of a second) and call it without Dynamo's tracing, guards or wrappers.

An artefact's name is a digest of everything that changes it (``ArtefactKey``): the weights,
the key's shape, the compile settings, the dtype, torch's version, the CPU's instruction set,
the thread count and the source of the code the forward runs. A different model or torch
gives a different name, so a stale artefact is never found; one that fails to load (a
truncated write, a corrupt file) is deleted and rebuilt. A build writes to a private temporary
file and renames it into place, so processes building the same key at once (xdist workers)
never see half a package. The cache lives in ``$SPECGATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/specgate`` (``~/.cache/specgate``); ``specgate cache info|clear`` shows and
empties it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from refengine.graph.compile import FROZEN_WEIGHTS
from refengine.graph.executors import GraphKey, whole_forward
from refengine.graph.staging import StagedViews
from refengine.memory.kv_pool import KVPool
from refengine.model.llama import ForwardOutput, LlamaForCausalLM

CACHE_ENV = "SPECGATE_CACHE_DIR"
_REFENGINE = Path(__file__).resolve().parents[1]
# The code a compiled forward is made of: a change in any of these changes every artefact.
_FORWARD_SOURCES = ("model/llama.py", "model/attention.py", "graph/executors.py",
                    "graph/staging.py", "graph/compile.py", "graph/aot.py")


def cache_dir() -> Path:
    """Where packages are kept: ``$SPECGATE_CACHE_DIR``, else the platform's user cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgate"


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@functools.cache
def code_digest() -> str:
    h = hashlib.sha256()
    for rel in _FORWARD_SOURCES:
        h.update((_REFENGINE / rel).read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ArtefactKey:
    """Everything a package depends on; its file name is a digest of all of it."""

    weights: str
    kind: str
    bucket: int
    max_kv: int
    settings: str
    dtype: str
    torch: str
    isa: str
    threads: int
    code: str

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{self.kind}-b{self.bucket}-kv{self.max_kv}-{digest[:20]}.pt2"


class PackageCache:
    """Compiled packages on disk, one file per ``ArtefactKey``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or cache_dir()) / "aot"
        self.builds = 0  # packages this instance compiled (the rest it loaded)

    def load_or_build(self, key: ArtefactKey, build: Callable[[Path], None]) -> Any:
        """The loaded package of ``key``: from the cache, or built by ``build(path)`` (which
        writes a package at ``path``) and stored first. A file that fails to load is deleted
        and rebuilt."""
        path = self.root / key.file_name()
        if path.exists():
            try:
                return torch._inductor.aoti_load_package(str(path))
            except Exception:  # any failure to load means: not usable
                path.unlink(missing_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        # private to this build, and still a ".pt2" (the packager insists on the suffix)
        temporary = path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex}-{path.name}")
        try:
            build(temporary)
            self.builds += 1
            os.replace(temporary, path)  # atomic: a reader sees no package or a whole one
        finally:
            temporary.unlink(missing_ok=True)
        return torch._inductor.aoti_load_package(str(path))

    def entries(self) -> list[Path]:
        """The packages (not the temporaries of builds under way or killed)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.pt2") if not p.name.startswith("."))

    def clear(self) -> int:
        """Delete every package and any temporary a killed build left; -> packages deleted."""
        removed = 0
        if self.root.is_dir():
            for p in self.root.glob("*.pt2"):
                p.unlink(missing_ok=True)
                removed += not p.name.startswith(".")
        return removed


class _KeyForward(torch.nn.Module):
    """The graph runner's whole forward at one key width, as a module to export (its weights
    are the model's; the pools, staged views and row table are its inputs)."""

    def __init__(self, model: LlamaForCausalLM, max_kv: int) -> None:
        super().__init__()
        self.model, self.max_kv = model, max_kv

    def forward(self, k_pool: torch.Tensor, v_pool: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, out_slots: torch.Tensor, rows: torch.Tensor,
                seq_lens: torch.Tensor, tree_mask: torch.Tensor, table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return whole_forward(self.model, k_pool, v_pool, input_ids, positions, out_slots,
                              rows, seq_lens, tree_mask, table, self.max_kv)


class AotExecutor:
    """The target's decode and verify keys as persistent AOTInductor packages (module
    docstring); each loaded package is called directly with the staged views."""

    name = "aot"
    outputs_persist = False  # a package allocates its outputs per call

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, table: torch.Tensor,
                 cache: PackageCache | None = None) -> None:
        self.model, self.kv, self.table = model, kv, table
        self.cache = cache or PackageCache()
        self._loaded: dict[GraphKey, Any] = {}
        self._weights: str | None = None

    def artefact_key(self, key: GraphKey) -> ArtefactKey:
        if self._weights is None:
            self._weights = weights_digest(self.model)
        return ArtefactKey(self._weights, key.kind, key.bucket, key.max_kv,
                           json.dumps(FROZEN_WEIGHTS, sort_keys=True),
                           str(self.kv.k.dtype), torch.__version__,
                           torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                           code_digest())

    def _inputs(self, views: StagedViews) -> list[torch.Tensor]:
        return [self.kv.k, self.kv.v, views.input_ids, views.positions, views.out_slots,
                views.rows, views.seq_lens, views.tree_mask, self.table]

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        if key in self._loaded:
            return

        def build(path: Path) -> None:
            with torch.no_grad():
                program = torch.export.export(_KeyForward(self.model, key.max_kv).eval(),
                                              tuple(self._inputs(views)), strict=False)
            torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                     inductor_configs=dict(FROZEN_WEIGHTS))

        self._loaded[key] = self.cache.load_or_build(self.artefact_key(key), build)

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        self.prepare(key, views)
        with torch.inference_mode():
            logits, features = self._loaded[key].loader.run(self._inputs(views))
        return ForwardOutput(logits, features)
