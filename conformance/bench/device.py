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
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            self.sync()
        events = prof.events()
        on_device = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
        if not on_device:  # device events only attached to the host ops that launched them
            on_device = sum(k.duration for e in events for k in e.kernels)
        return on_device / 1e6
