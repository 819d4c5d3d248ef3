"""``paged_attention`` against a plain per-request causal attention, for uniform batches (the
unpadded fast path: decode, verify, draft steps) and ragged ones (request by request, the CPU's
route, and padded into one block, a GPU's), and the visibility rule every metadata comes
from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.model.attention import (
    AttentionMetadata,
    LazyAttention,
    padded_attention,
    paged_attention,
    visible_keys,
)

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 256


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """One request: q [n, H, D] at positions prefix.., k/v [prefix + n, KVH, D]."""
    n = q.shape[0]
    rep = HEADS // KV_HEADS
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1),
                                         vv.transpose(0, 1), attn_mask=mask, scale=DIM ** -0.5)
    return out.transpose(0, 1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 5)), min_size=1, max_size=4),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_matches_per_request_attention(shape: list[tuple[int, int]], uniform: bool,
                                       seed: int) -> None:
    """``shape``: (cached prefix, new tokens) per request; ``uniform`` gives every request the
    first request's new-token count."""
    if uniform:
        shape = [(prefix, shape[0][1]) for prefix, _ in shape]
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    table = torch.randperm(SLOTS, generator=gen)[: len(shape) * 32].view(len(shape), 32)
    extend = [n for _, n in shape]
    seq = [p + n for p, n in shape]
    q = torch.randn(sum(extend), HEADS, DIM, generator=gen)
    meta = AttentionMetadata.build(table, torch.arange(len(shape)), extend, seq)
    assert (meta.ragged is None) == (len(set(extend)) == 1)
    routes = [paged_attention(q, k_cache, v_cache, meta, DIM ** -0.5)]
    if meta.ragged is not None:  # the GPU's route for a ragged batch, checked here on the CPU
        routes.append(padded_attention(q, k_cache, v_cache, meta, DIM ** -0.5))
    for out in routes:
        start = 0
        for row, (prefix, n) in enumerate(shape):
            slots = table[row, : prefix + n]
            want = naive(q[start:start + n], k_cache[slots], v_cache[slots], prefix)
            torch.testing.assert_close(out[start:start + n], want)
            start += n


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 5)), min_size=1, max_size=4),
       st.booleans(), st.data())
def test_at_queries_is_the_full_attention_at_those_tokens(
        shape: list[tuple[int, int]], uniform: bool, data: st.DataObject) -> None:
    """Attention for a subset of the new tokens (possibly none, in any order) equals the full
    batch's attention at those tokens."""
    if uniform:
        shape = [(prefix, shape[0][1]) for prefix, _ in shape]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    k_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    table = torch.randperm(SLOTS, generator=gen)[: len(shape) * 32].view(len(shape), 32)
    extend = [n for _, n in shape]
    q = torch.randn(sum(extend), HEADS, DIM, generator=gen)
    meta = AttentionMetadata.build(table, torch.arange(len(shape)), extend,
                                   [p + n for p, n in shape])
    keep = torch.tensor(data.draw(st.lists(st.integers(0, sum(extend) - 1), unique=True)),
                        dtype=torch.int64)
    full = paged_attention(q, k_cache, v_cache, meta, DIM ** -0.5)
    part = paged_attention(q[keep], k_cache, v_cache, meta.at_queries(keep), DIM ** -0.5)
    assert part.shape == (len(keep), HEADS, DIM)
    torch.testing.assert_close(part, full[keep])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=4), st.integers(1, 4),
       st.integers(1, 6), st.booleans(), st.integers(0, 2**31 - 1))
def test_visible_keys_is_prefix_and_block(prefixes: list[int], queries: int, m: int,
                                          causal: bool, seed: int) -> None:
    """The one visibility rule, against its statement checked position by position: a query
    sees its request's prefix and, of the block after it, what its row of the block mask (or
    the causal block) allows; nothing past. Both the eager and the graph metadata come from
    it."""
    gen = torch.Generator().manual_seed(seed)
    if causal:
        m, block = queries, None
    else:
        block = torch.rand((len(prefixes), queries, m), generator=gen) < 0.5
    width = max(prefixes) + m + 2  # columns past every block
    mask = visible_keys(torch.tensor(prefixes), width, block, queries)
    assert mask.shape == (len(prefixes), 1, queries, width)
    for b, prefix in enumerate(prefixes):
        for i in range(queries):
            for j in range(width):
                if j < prefix:
                    want = True
                elif j >= prefix + m:
                    want = False
                elif block is None:
                    want = j - prefix <= i
                else:
                    want = bool(block[b, i, j - prefix])
                assert bool(mask[b, 0, i, j]) == want, (b, i, j)


def test_build_places_custom_masks_after_the_prefix() -> None:
    """A custom mask ``[n, m]`` covers the last ``m`` key positions; every earlier position is
    visible, none past the request's length (shorter requests in a wider batch)."""
    table = torch.arange(2 * 16).view(2, 16)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = AttentionMetadata.build(table, torch.tensor([1, 0]), [3, 3], [7, 10], [tree, tree])
    assert meta.ragged is None and meta.mask.shape == (2, 1, 3, 10)
    assert torch.equal(meta.kv_slots, table[[1, 0], :10])
    for b, end in enumerate((7, 10)):
        assert meta.mask[b, 0, :, :end - 3].all()
        assert torch.equal(meta.mask[b, 0, :, end - 3:end], tree)
        assert not meta.mask[b, 0, :, end:].any()


def test_lazy_attention_builds_once_on_first_use() -> None:
    """``LazyAttention`` is the builder's metadata, built on the first field read and only then;
    a ragged batch's metadata is refused (its padding needs the unpad index up front)."""
    table = torch.arange(2 * 16).view(2, 16)
    calls: list[int] = []

    def build(lens: list[int]) -> AttentionMetadata:
        calls.append(1)
        return AttentionMetadata.build(table, torch.tensor([1, 0]), lens, [7, 10])

    lazy = LazyAttention(lambda: build([2, 2]))
    assert lazy.ragged is None and lazy.unpad_index is None and not calls
    want = build([2, 2])
    assert torch.equal(lazy.mask, want.mask) and torch.equal(lazy.kv_slots, want.kv_slots)
    assert torch.equal(lazy.at_queries(torch.tensor([1])).mask, want.at_queries(
        torch.tensor([1])).mask)
    assert len(calls) == 2  # the reference build, and the lazy one once
    with pytest.raises(ValueError, match="ragged"):
        _ = LazyAttention(lambda: build([1, 2])).mask
