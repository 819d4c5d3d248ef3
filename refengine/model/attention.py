"""Attention over the paged KV cache, in torch.

One metadata serves prefill with a cached prefix (extend), decode, and tree verify: each
request's keys are gathered through its ``req_to_token`` row, and a boolean mask says which key
positions each query may see (``visible_keys``, the one rule, which the graphs use too). By
default that is causal over absolute positions; a request may instead carry a custom mask over
its new tokens (the tree mask of EAGLE verify), with the whole cached prefix visible. When
every request brings the same number of new tokens (decode, verify, draft steps) attention runs
once over the ``[batch, max_q, max_kv]`` block; when they differ (a batch of prefills) the
device decides: on the CPU it runs request by request (``ragged_attention``), since padding
every prompt to the longest one's square costs far more compute than the loop; on a GPU it
pads the queries into that block (``padded_attention``), since there the loop's launches per
request and layer cost far more than the padding's idle lanes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from refengine.device import from_host


def visible_keys(prefix_lens: torch.Tensor, width: int, block_mask: torch.Tensor | None = None,
                 queries: int = 1) -> torch.Tensor:
    """The visibility rule, for every forward: ``[B, 1, q, width]``, may query i of request b
    see its key column j.

    Every query sees its request's prefix ``[0, prefix_len)`` and, of the ``m`` columns after
    it, those its row of ``block_mask [B, q, m]`` allows (None: the causal block of ``queries``
    queries, query i sees the first i + 1); nothing else. A prefill or decode (causal), the
    verify block (the tree mask) and a draft step (each node's ancestors among the scratch
    entries) are all this. Tensor ops on shapes the arguments fix (no host sync), so graphs
    derive it too."""
    columns = torch.arange(width, device=prefix_lens.device)
    if block_mask is None:
        last = prefix_lens[:, None] + torch.arange(queries, device=prefix_lens.device)
        return (columns[None, None, :] <= last[:, :, None])[:, None]
    q, m = block_mask.shape[1], block_mask.shape[2]
    rel = columns[None, :] - prefix_lens[:, None]                          # [B, width]
    block = block_mask.gather(2, rel.clamp(0, m - 1)[:, None, :].expand(-1, q, -1))
    return ((rel < 0)[:, None, :] | (block & (rel < m)[:, None, :]))[:, None]


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward.

    ``kv_slots[b, j]``: KV slot of request b's position j. ``mask[b, 1, i, j]``: may query i of
    request b see position j. When every request brings the same number of new tokens (decode,
    verify, a draft step: the common case), the flat tokens already are ``[batch, max_q]`` and
    the last two fields are None. When the numbers differ (a batch of prefills), ``ragged``
    lists per request (new tokens, keys), for causal attention request by request, and
    ``unpad_index`` the flat positions of the real tokens in a ``[batch * max_q]`` layout of
    the mask's query rows, in token order (``at_queries`` picks rows of the mask through it).
    """

    kv_slots: torch.Tensor
    mask: torch.Tensor
    unpad_index: torch.Tensor | None = None
    ragged: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def over_blocks(cls, table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                    width: int, block_mask: torch.Tensor | None = None, queries: int = 1
                    ) -> AttentionMetadata:
        """Attention over the first ``width`` key columns of each request's row of ``table``,
        ``visible_keys`` saying which each query sees."""
        kv_slots = table[:, :width].index_select(0, rows)                  # [B, width]
        return cls(kv_slots, visible_keys(prefix_lens, width, block_mask, queries))

    @classmethod
    def build(cls, req_to_token: torch.Tensor, rows: torch.Tensor, extend_lens: list[int],
              seq_lens: list[int], custom_masks: list[torch.Tensor] | None = None
              ) -> AttentionMetadata:
        """``seq_lens[b]`` counts request b's positions after this forward's KV is written;
        its new tokens are the last ``extend_lens[b]`` of them. ``custom_masks[b]``, if given,
        is an ``[extend_len, m]`` bool mask over the last ``m >= extend_len`` key positions
        (the tree among the new tokens, or a draft beam's scratch entries), one shape for every
        request; every earlier position stays visible. Without, attention is causal."""
        max_q, max_kv = max(extend_lens), max(seq_lens)
        if custom_masks is None:
            prefix = [s - n for s, n in zip(seq_lens, extend_lens, strict=True)]
            block = None
        else:
            shape = custom_masks[0].shape
            if (any(m.shape != shape for m in custom_masks)
                    or any(n != shape[0] for n in extend_lens)):
                raise ValueError(f"custom masks: one [extend_len, m] shape for every request, "
                                 f"got {[tuple(m.shape) for m in custom_masks]}")
            prefix = [s - shape[1] for s in seq_lens]
            block = torch.stack(custom_masks)
        device = req_to_token.device
        meta = cls.over_blocks(req_to_token, rows, from_host(prefix, device), max_kv, block,
                               max_q)
        if all(n == max_q for n in extend_lens):
            return meta
        # Padded query rows are never read: a ragged batch attends over each request's own
        # rows and keys, and ``unpad_index`` picks the real rows.
        meta.unpad_index = from_host([b * max_q + i for b, n in enumerate(extend_lens)
                                      for i in range(n)], device)
        meta.ragged = tuple(zip(extend_lens, seq_lens, strict=True))
        return meta

    def at_queries(self, tokens: torch.Tensor) -> AttentionMetadata:
        """The same keys and visibility for the flat new tokens ``tokens`` only, each its own
        one-query row: for a forward whose other rows only write KV."""
        batch, _, max_q, max_kv = self.mask.shape
        padded = tokens if self.unpad_index is None else self.unpad_index[tokens]
        mask = self.mask.view(batch * max_q, max_kv).index_select(0, padded)
        kv_slots = self.kv_slots.index_select(0, padded // max_q)
        return AttentionMetadata(kv_slots, mask[:, None, None, :])


class LazyAttention(AttentionMetadata):
    """The metadata of a uniform batch (every request brings the same number of new tokens:
    decode, verify), built on first use. A graphed forward derives its own attention from the
    staged rows and lengths and never reads this, so building it up front would be host work
    (ops and host-to-device copies, a launch each on a GPU) for nothing; an eager forward,
    or a draft forward that reuses the target batch's metadata, builds it when it reads a
    field. ``build`` must give a uniform batch's metadata (not ragged) from state that does
    not change before the batch's forward (the row table's rows for its requests)."""

    def __init__(self, build: Callable[[], AttentionMetadata]) -> None:
        self._build = build
        self.unpad_index = None  # uniform: no padded rows, one block
        self.ragged = None

    @cached_property
    def built(self) -> AttentionMetadata:
        meta = self._build()
        if meta.ragged is not None:
            raise ValueError("LazyAttention: the batch is ragged; build its metadata eagerly")
        return meta

    @property  # type: ignore[override]
    def kv_slots(self) -> torch.Tensor:
        return self.built.kv_slots

    @property  # type: ignore[override]
    def mask(self) -> torch.Tensor:
        return self.built.mask


def ragged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention`` of a padded batch, one request at a time: each attends over its own
    keys only, and a request whose keys are exactly its new tokens (a prefill with nothing
    cached) runs ``is_causal`` with no mask at all, which lets SDPA pick its fused CPU kernel
    instead of the masked path."""
    assert meta.ragged is not None
    heads = q.shape[1]
    outs, start = [], 0
    for b, (n, s) in enumerate(meta.ragged):
        qb = q[start:start + n].transpose(0, 1)[None]                     # [1, H, n, D]
        slots = meta.kv_slots[b, :s]
        kb = k_cache.index_select(0, slots).transpose(0, 1)[None]         # [1, KVH, s, D]
        vb = v_cache.index_select(0, slots).transpose(0, 1)[None]
        causal = s == n
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=None if causal else meta.mask[b:b + 1, :, :n, :s],
            is_causal=causal, scale=scale, enable_gqa=heads != kb.shape[1])
        outs.append(out[0].transpose(0, 1))                               # [n, H, D]
        start += n
    return torch.cat(outs)


def padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention`` of a ragged batch in one launch: the flat queries scattered into the
    mask's ``[batch * max_q]`` rows, attention over the whole block, the real rows picked back.
    A padded row sees at least its request's first key (the rule always shows column 0), so it
    never turns into NaN, and it is dropped."""
    assert meta.unpad_index is not None
    batch, _, max_q, _ = meta.mask.shape
    rows = q.new_zeros(batch * max_q, *q.shape[1:]).index_copy_(0, meta.unpad_index, q)
    return block_attention(rows, k_cache, v_cache, meta, scale).index_select(0, meta.unpad_index)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, dim]; caches: [slots, kv_heads, dim] -> [tokens, heads, dim]."""
    if meta.ragged is None:
        return block_attention(q, k_cache, v_cache, meta, scale)
    if q.device.type == "cpu":
        return ragged_attention(q, k_cache, v_cache, meta, scale)
    return padded_attention(q, k_cache, v_cache, meta, scale)


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention over the ``[batch, max_q, max_kv]`` block, q: [batch * max_q, heads, dim]."""
    _, heads, dim = q.shape
    batch, _, max_q, _ = meta.mask.shape
    q_pad = q.view(batch, max_q, heads, dim).transpose(1, 2)         # [B, H, max_q, D]
    # index_select over flat slots: a plain row gather, cheaper than advanced indexing with
    # the [B, max_kv] table.
    flat, kv_shape = meta.kv_slots.reshape(-1), (*meta.kv_slots.shape, *k_cache.shape[1:])
    k = k_cache.index_select(0, flat).view(kv_shape).transpose(1, 2)  # [B, KVH, max_kv, D]
    v = v_cache.index_select(0, flat).view(kv_shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=heads != k.shape[1])
    return out.transpose(1, 2).reshape(-1, heads, dim)               # [B * max_q, H, D]
