"""KVPool: every layer's K and V by slot, zero until written."""

from __future__ import annotations

import pytest
import torch

from refengine.memory.kv_pool import KVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_starts_zeroed_and_keeps_writes(dtype: torch.dtype) -> None:
    """The CPU pool's lazily zeroed memory reads as zeros everywhere until written, and keeps
    what is written (a stale value in a slot never written would be read by padded rows)."""
    pool = KVPool(64, 3, 2, 4, dtype, "cpu")
    assert pool.k.shape == pool.v.shape == (3, 64, 2, 4)
    assert pool.k.dtype == dtype and pool.k.is_contiguous()
    assert not pool.k.any() and not pool.v.any()
    pool.write(1, torch.tensor([5, 9]), torch.ones(2, 2, 4, dtype=dtype),
               torch.full((2, 2, 4), 2.0, dtype=dtype))
    assert pool.k[1, [5, 9]].eq(1).all() and pool.v[1, [5, 9]].eq(2).all()
    assert pool.k.sum() == 16 and pool.v.sum() == 32
    assert not pool.k[0].any() and not pool.k[2].any()
