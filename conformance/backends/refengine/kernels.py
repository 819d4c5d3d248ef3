"""The reference engine's tree kernels for the kernel tier (``KernelImpls``,
``conformance/checks/tree_cases.py``): the Triton kernels, or why they cannot run here."""

from __future__ import annotations

from conformance.contract import KernelImpls
from refengine.kernels.tree_triton import (
    NOT_RUNNABLE,
    build_tree_triton,
    interpreter_enabled,
    triton_runnable,
    verify_tree_greedy_triton,
)

__all__ = ["default_kernels_for_refengine", "triton_kernels", "triton_runnable"]


def triton_kernels() -> KernelImpls:
    """The Triton kernels. Calling them raises ``RuntimeError`` where Triton cannot run (see
    ``triton_runnable``), so a backend should only hand these out when it can. Importing this
    module never imports Triton: ``tree_triton`` does that on first use. Under the interpreter
    they run on CPU tensors; otherwise they are compiled for the GPU and take CUDA tensors."""
    return KernelImpls("triton", build_tree_triton, verify_tree_greedy_triton,
                       device="cpu" if interpreter_enabled() else "cuda")


def default_kernels_for_refengine() -> KernelImpls:
    """What the reference engine's backend exposes: the Triton kernels, marked unavailable
    where they cannot run (the engine itself then uses the torch references, which are what
    the tier compares against, so there is nothing to certify)."""
    if triton_runnable():
        return triton_kernels()
    return KernelImpls("triton", build_tree_triton, verify_tree_greedy_triton,
                       unavailable=f"{NOT_RUNNABLE} (or Triton is not installed); the engine "
                                   "runs the torch references this tier compares against")
