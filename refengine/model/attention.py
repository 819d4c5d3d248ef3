"""Attention over the paged KV cache, in torch (the CPU path).

One code path serves prefill with a cached prefix (extend), decode, and tree verify: queries are
padded to ``[batch, max_q]``, each request's keys are gathered through its ``req_to_token`` row,
and a boolean mask says which key positions each query may see. By default that is causal over
absolute positions; a request may instead carry a custom mask over its new tokens (the tree mask
of EAGLE verify), with the whole cached prefix visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward.

    ``query_index[b, i]``: flat token index of request b's i-th new token (``num_tokens``, one
    past the end, for padding). ``kv_slots[b, j]``: KV slot of request b's position j.
    ``mask[b, 1, i, j]``: may query i of request b see position j. ``unpad_index``: flat
    positions in the padded ``[batch * max_q]`` layout of the real tokens, in token order.
    """

    query_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    unpad_index: torch.Tensor

    @classmethod
    def build(cls, req_to_token: torch.Tensor, rows: torch.Tensor, extend_lens: list[int],
              seq_lens: list[int], custom_masks: list[torch.Tensor | None] | None = None
              ) -> AttentionMetadata:
        """``seq_lens[b]`` counts request b's positions after this forward's KV is written;
        its new tokens are the last ``extend_lens[b]`` of them. ``custom_masks[b]``, if given, is
        an ``[extend_len, m]`` bool mask over the last ``m >= extend_len`` key positions (the
        tree among the new tokens, or a draft beam's scratch entries); every earlier position
        stays visible.
        """
        batch, max_q, max_kv = len(extend_lens), max(extend_lens), max(seq_lens)
        q_lens = torch.tensor(extend_lens)
        kv_lens = torch.tensor(seq_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens
        num_tokens = int(q_lens.sum())
        i = torch.arange(max_q)
        valid_q = i[None, :] < q_lens[:, None]
        query_index = torch.where(valid_q, starts[:, None] + i[None, :], num_tokens)
        prefix = kv_lens - q_lens
        q_pos = prefix[:, None] + i[None, :]                          # [B, max_q]
        j = torch.arange(max_kv)
        mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        if custom_masks is not None:
            for b, custom in enumerate(custom_masks):
                if custom is not None:
                    n, end = extend_lens[b], seq_lens[b]
                    mask[b, :n, end - custom.shape[1]:end] = custom
        # Padded query rows see position 0 only, so softmax stays finite; their output is dropped.
        mask[:, :, 0] |= ~valid_q
        kv_slots = req_to_token[rows][:, :max_kv]
        unpad_index = (torch.arange(batch)[:, None] * max_q + i[None, :])[valid_q]
        return cls(query_index, kv_slots, mask[:, None], unpad_index)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, dim]; caches: [slots, kv_heads, dim] -> [tokens, heads, dim]."""
    _, heads, dim = q.shape
    q_ext = torch.cat([q, q.new_zeros(1, heads, dim)])
    q_pad = q_ext[meta.query_index].transpose(1, 2)                  # [B, H, max_q, D]
    k = k_cache[meta.kv_slots].transpose(1, 2)                       # [B, KVH, max_kv, D]
    v = v_cache[meta.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=heads != k.shape[1])
    out = out.transpose(1, 2).reshape(-1, heads, dim)                # [B * max_q, H, D]
    return out[meta.unpad_index]
