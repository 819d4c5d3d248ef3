"""``--device`` (certify, bench) and ``--specgate-device``: where the backend runs, checked
before any work. ``cpu`` always works; ``cuda`` and ``cuda:N`` need torch to see that CUDA
device, and the ``cuda`` graph executor (CUDA graphs) needs a CUDA device to capture on.
``--graphs auto`` picks the graph executor for the device (``best_graphs``)."""

from __future__ import annotations

import argparse

from conformance.contract import is_device_name

DEVICE_HELP = ("where the backend runs: cpu, cuda or cuda:N (torch must see that CUDA device); "
               "the suite's float32 reference stays on the CPU")


def device_arg(text: str) -> str:
    """argparse type: a device name, or the one-line reason it is not one."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def device_problem(device: str, graphs: str | None) -> str | None:
    """Why ``device`` (with graph executor ``graphs``) cannot run here, as one line naming the
    option; None when it can."""
    if not is_device_name(device):
        return f"--device: expected cpu, cuda or cuda:N, got {device!r}"
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            return f"--device {device}: torch sees no CUDA device (torch.cuda.is_available() " \
                   "is False)"
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            return f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    if graphs == "cuda" and device == "cpu":
        return "--graphs cuda: CUDA graphs need a CUDA device (add --device cuda)"
    return None


def best_graphs(graphs: str | None, device: str) -> str | None:
    """What ``--graphs`` asks for on ``device``: ``auto`` is the fastest executor the graph tier
    passes on there (CUDA graphs on a GPU; on the CPU, AOT packages: compiled once per
    machine, loaded by later runs), ``none`` is off, any other name is itself."""
    if graphs == "auto":
        return "aot" if device == "cpu" else "cuda"
    return None if graphs == "none" else graphs
