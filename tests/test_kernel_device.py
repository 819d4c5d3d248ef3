"""The kernel tier's device plumbing, on a machine without a GPU: kernels on a CUDA device get
their inputs there (``KernelImpls.device``, or the run's ``--device``); the comparison with the
torch references stays on the CPU. The compiled kernels themselves run in the GPU checks."""

from __future__ import annotations

import pytest
import torch

from conformance.backends.refengine.kernels import triton_kernels
from conformance.contract import KernelImpls
from conformance.suites.test_kernel import kernel_device, on_device


def test_kernels_take_their_inputs_on_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel tier moves every tensor argument to the kernels' device (here the meta
    device stands in for a GPU) and leaves CPU kernels' calls alone."""
    seen: list[torch.device] = []

    def kernel(a: torch.Tensor, b: torch.Tensor, depth: int) -> int:
        seen.extend([a.device, b.device])
        return depth

    assert on_device(kernel, "cpu") is kernel
    assert on_device(kernel, "meta")(torch.zeros(2), torch.ones(3), 4) == 4
    assert seen == [torch.device("meta")] * 2
    cpu_impls = KernelImpls("k", None, None)
    assert kernel_device(cpu_impls, "cpu") == "cpu"
    assert kernel_device(cpu_impls, "cuda:1") == "cuda:1"  # the run's --device
    assert kernel_device(KernelImpls("k", None, None, device="cuda"), "cpu") == "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_kernels().device == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_kernels().device == "cuda"  # compiled Triton takes CUDA tensors
