"""KVPool: the K and V tensors of every layer, indexed by KV slot."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is an anonymous mapping: the kernel hands out zero
    pages as they are first touched, so a pool sized for the worst case costs only the slots a
    run writes (filling it with zeros up front cost most of an engine's start-up)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVPool:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v
