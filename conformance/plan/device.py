"""``--device`` (certify, bench) and ``--specgate-device``: where the backend runs, and which
graph executors can run there, checked before any work. ``cpu`` always works; ``cuda`` and
``cuda:N`` need torch to see that CUDA device. The executor registry
(``refengine.graph.executors``) says on which device each executor runs; ``--graphs auto`` is
the device's own default executor there (``best_graphs``)."""

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


def _cuda_problem(device: str) -> str | None:
    """Why torch cannot run on CUDA device ``device`` here; None when it can."""
    import torch

    if not torch.cuda.is_available():
        return f"--device {device}: torch sees no CUDA device (torch.cuda.is_available() is False)"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


def _executor_problem(device: str, graphs: str | None) -> str | None:
    """Why graph executor ``graphs`` cannot run on ``device`` (the registry's device rule), as
    one line naming the option; None when it can, or when no executor is asked for."""
    from refengine.graph.executors import executor_info

    if graphs is None:
        return None
    info = executor_info(graphs)
    if info.runs_on(device):
        return None
    if info.device == "cuda":
        return f"--graphs {graphs}: {info.label} need a CUDA device (add --device cuda)"
    return f"--graphs {graphs}: {info.device_problem(device)}"


def device_problem(device: str, graphs: str | None) -> str | None:
    """Why ``device`` (with graph executor ``graphs``) cannot run here, as one line naming the
    option; None when it can."""
    if not is_device_name(device):
        return f"--device: expected cpu, cuda or cuda:N, got {device!r}"
    cuda = _cuda_problem(device) if device != "cpu" else None
    return cuda or _executor_problem(device, graphs)


def best_graphs(graphs: str | None, device: str) -> str | None:
    """What ``--graphs`` asks for on ``device``: ``auto`` is the device's default executor (the
    fastest one the graph tier passes on there), ``none`` is off, any other name is itself."""
    from refengine.graph.executors import default_executor

    if graphs == "auto":
        return default_executor(device)
    return None if graphs == "none" else graphs
