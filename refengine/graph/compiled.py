"""The "compiled" and "frozen" executors: ``torch.compile`` per key of the program's key
module (inductor, ``fullgraph``, static shapes), the KV writes kept out of the traced pool
updates by the module's own ``InPlaceKV`` (``compile.py``).

The inductor FX-graph and AOT-autograd caches are switched on around compilation, so a key
compiled once on a machine (cache directory ``TORCHINDUCTOR_CACHE_DIR``, by default under the
temp directory) only pays Dynamo tracing and a cache load in later processes.
``backend="eager"`` generates no code (Dynamo traces, the graph runs as plain torch): the tests
use it to check the compiled forward gives the model's bits. ``freeze_weights`` (the "frozen"
executor, see ``compile.FROZEN_WEIGHTS``): faster keys that every process compiles again; the
model's weights must not change after a key is compiled.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Generic

import torch

from refengine.graph.compile import WarmKeys, own_code
from refengine.graph.program import K2, R2, V2, Executor, K, Program, R, V


def _call(module: torch.nn.Module, *inputs: torch.Tensor) -> Any:
    return module(*inputs)


class CompiledKey:
    """One key's module compiled in this process (one code object per key, ``own_code``),
    its first call compiling it, later ones skipping the guards that cannot fail
    (``WarmKeys``); gone when the process ends."""

    def __init__(self, module: torch.nn.Module, key: Hashable, backend: str = "inductor",
                 freeze_weights: bool = False) -> None:
        self.module, self.key = module.eval(), key
        self._forward = torch.compile(own_code(_call), backend=backend, fullgraph=True,
                                      dynamic=False)
        self._warm = WarmKeys(freeze_weights)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._warm.settings(self.key), torch.inference_mode():
            return list(self._forward(self.module, *inputs))


class CompiledExecutor(Generic[K, V, R]):
    """Each key of ``program`` compiled on its first use (module docstring)."""

    outputs_persist = False  # inductor allocates outputs per call

    def __init__(self, program: Program[K, V, R], backend: str = "inductor",
                 freeze_weights: bool = False) -> None:
        self.program, self.backend, self.freeze_weights = program, backend, freeze_weights
        self.name = "frozen" if freeze_weights else "compiled"
        self._keys: dict[K, CompiledKey] = {}

    def prepare(self, key: K, views: V) -> None:
        self.run(key, views)

    def run(self, key: K, views: V) -> R:
        if key not in self._keys:
            self._keys[key] = CompiledKey(self.program.module(key), key, self.backend,
                                          self.freeze_weights)
        return self.program.outputs(self._keys[key].run(self.program.inputs(views)))

    def pending(self) -> list[K]:
        return []  # a key compiles wherever it is first needed

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        return CompiledExecutor(program, self.backend, self.freeze_weights)
