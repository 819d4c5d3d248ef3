"""Host data onto the engine's device: the one way a Python list becomes a device tensor.

A plain ``torch.tensor(values, device="cuda")`` copies synchronously (PyTorch waits for the
stream after a blocking host-to-device copy), which would put a host round-trip into every
batch a step builds. Here the list becomes a CPU tensor, is pinned and copied with
``non_blocking=True``: the copy is queued on the stream like any kernel, and PyTorch's pinned
memory pool keeps the source alive until it ran. On the CPU it is the CPU tensor itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def from_host(values: Sequence[Any], device: torch.device | str,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (nested lists of numbers or bools) as one ``dtype`` tensor on ``device``."""
    host = torch.tensor(values, dtype=dtype, device="cpu")
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
