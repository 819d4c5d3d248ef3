"""The reference engine's tree kernels for the kernel tier (``KernelImpls``,
``conformance/checks/tree_cases.py``): Triton where it can run, else the torch references."""

from __future__ import annotations

from conformance.contract import KernelImpls
from refengine.kernels.tree_reference import build_tree_reference, verify_tree_greedy_reference
from refengine.kernels.tree_triton import (
    build_tree_triton,
    triton_runnable,
    verify_tree_greedy_triton,
)

__all__ = ["default_kernels_for_refengine", "reference_kernels", "triton_kernels",
           "triton_runnable"]


def reference_kernels() -> KernelImpls:
    """The torch references themselves (what the reference engine runs on CPU)."""
    return KernelImpls("torch-reference", build_tree_reference, verify_tree_greedy_reference)


def triton_kernels() -> KernelImpls:
    """The Triton kernels. Calling them raises ``RuntimeError`` where Triton cannot run (see
    ``triton_runnable``), so a backend should only hand these out when it can. Importing this
    module never imports Triton: ``tree_triton`` does that on first use."""
    return KernelImpls("triton", build_tree_triton, verify_tree_greedy_triton)


def default_kernels_for_refengine() -> KernelImpls:
    """What the reference engine's backend exposes: Triton when it can run here, else the
    torch references (which then certify trivially against themselves — the point of the tier
    on CPU without the interpreter is only that the hook works)."""
    return triton_kernels() if triton_runnable() else reference_kernels()
