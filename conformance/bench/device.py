"""What the bench measures on a CUDA device beyond wall time: the device time of the kernels a
run launched, the peak of allocated GPU memory, and a synchronisation so a timed region ends
when the device has finished, not when the host has queued the work.

Device time comes from the profiler (CUPTI): the sum of the durations of every kernel and copy
the run put on the device, in an untimed pass of its own (profiling slows the host). It is the
floor a step cannot go below whatever the host does, so ``1 - device / wall`` is the host-side
share of a step. On the CPU every method is a no-op returning None, so the CPU bench is the
same with or without this meter.
"""

from __future__ import annotations

from collections.abc import Callable


class DeviceMeter:
    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device != "cpu"

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA); nothing on the CPU."""
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated_bytes(self) -> int | None:
        """GPU memory allocated now (None on the CPU)."""
        if not self.cuda:
            return None
        import torch
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int | None:
        """Peak allocated GPU memory since ``reset_peak`` (None on the CPU)."""
        if not self.cuda:
            return None
        import torch
        return int(torch.cuda.max_memory_allocated(self.device))

    def name(self) -> str:
        """The device's name ("cpu" on the CPU)."""
        if not self.cuda:
            return "cpu"
        import torch
        return torch.cuda.get_device_name(torch.device(self.device))

    def kernel_seconds(self, run: Callable[[], object]) -> float | None:
        """Call ``run`` under the profiler; -> seconds of device time its kernels and copies
        took, summed (None on the CPU)."""
        if not self.cuda:
            return None
        return kernel_time(run, self.sync)[0]


def kernel_time(run: Callable[[], object], sync: Callable[[], None]) -> tuple[float, int]:
    """``run`` under the profiler, CUDA activity only (recording every host op too made a
    bench pass many times slower on a GPU) -> (seconds of device time of the kernels and copies
    it put on the device, summed; how many there were). A CUDA graph's replay counts each of
    its kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6, len(kernels)
