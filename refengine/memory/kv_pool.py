"""KVPool: the K and V tensors of every layer, indexed by KV slot."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v
