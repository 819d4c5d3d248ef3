"""What vLLM needs of this process, and what it changes in it: vLLM's environment (set when this
module is imported, so every module here that imports vLLM imports this first), its CPU
kernel-override registration made to run once, and torch's thread count put back after an
engine starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

# Engine core in this process (the suite drives one step at a time and reads the scheduler);
# a KV cache of 1 GiB unless the caller set one (vLLM's CPU default is a fraction of RAM).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

T = TypeVar("T")
# The platform classmethod patched below, and the mark its replacement carries.
REGISTER = "register_triton_kernel_overrides"
ONCE_MARK = "_specgate_once"


def kernel_overrides_once() -> None:
    """Make vLLM's CPU kernel-override registration run once per process.

    Every vLLM worker start calls ``current_platform.register_triton_kernel_overrides()``
    (v1/worker/worker_base.py), which on CPU swaps C++ stand-ins in for Triton kernels and
    rebinds every reference to them by scanning the namespace of every module in
    ``sys.modules`` (triton_utils/dispatcher.py ``_rebind_kernels``). Once an n-gram engine has
    run, numba has loaded llvmlite, whose library wrapper (``llvmlite.binding.ffi.lib``)
    answers any attribute, ``__dict__`` included, with a function wrapper: the scan then
    raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and no later
    engine in the process can start. The overrides are process-wide rebindings that stay in
    force, so registering again only re-wraps the wrappers; skipping later calls changes
    nothing else."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    register = getattr(platform, REGISTER)
    if getattr(register, ONCE_MARK, False):
        return
    done: list[bool] = []

    def once(cls: type) -> None:
        if not done:
            register()
            done.append(True)

    setattr(once, ONCE_MARK, True)
    setattr(platform, REGISTER, classmethod(once))


def threads_guarded(make: Callable[[], T]) -> T:
    """``make()`` with torch's thread count put back after. vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op for the rest of the process (v1/worker/
    cpu_worker.py ``skip_set_num_threads``) and lowers the thread count; the suite and other
    backends in this process set it themselves, so both are restored."""
    original = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        return make()
    finally:
        torch.set_num_threads = original
        torch.set_num_threads(threads)
