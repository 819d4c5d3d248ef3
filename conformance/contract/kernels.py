"""The kernel hook: how a backend exposes its tree kernels to the ``kernel`` tier.

Kernels are not part of the ``Backend`` protocol: most backends ship them inside the engine,
and a backend that cannot hand them out simply does not. One that can adds an optional method
``kernel_impls(self) -> KernelImpls``; the tier looks it up with
``getattr(backend, "kernel_impls", None)`` and reports the check as "not claimed" without it.
Each callable has exactly the signature of its torch reference in
``refengine.kernels.tree_reference`` and returns a result with the same fields (``Tree``:
tokens, positions, mask, retrieve_*; ``GreedyVerifyResult``), so the tier can compare every
field against the reference. ``None`` for a kernel means "this backend has no such kernel"
(also reported as not claimed). A backend whose kernels exist but cannot run in this process
(Triton without a GPU or its interpreter) says so in ``unavailable``: the tier reports its
checks not applicable with that reason. ``device`` is where the kernels take their inputs
(compiled GPU kernels: "cuda"); the tier builds every case on the CPU, hands the kernels its
inputs on that device (or on the run's ``--device`` when this says "cpu") and compares their
outputs with the references on the CPU. Handing out the torch references instead would make
the tier compare the references with themselves, a pass that checks nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the contract never imports torch at run time
    from torch import Tensor

BuildTree = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], Any]
VerifyGreedy = Callable[["Tensor", "Tensor", "Tensor", "Tensor", int], Any]


@dataclass(frozen=True)
class KernelImpls:
    """A backend's tree kernels. ``build_tree(root, cand_tokens, cand_parents, selected)`` and
    ``verify_greedy(tokens, next_token, next_sibling, target_predict, max_depth)``."""

    name: str
    build_tree: BuildTree | None
    verify_greedy: VerifyGreedy | None
    unavailable: str | None = None  # why the kernels cannot run here (None: they can)
    device: str = "cpu"  # where the kernels take their inputs: "cpu", "cuda" or "cuda:N"
