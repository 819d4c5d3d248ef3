"""A standalone draft model: a small Llama of its own (layers, embedding, LM head) that shares
only the target's tokenizer, as in classic draft-model speculative decoding.

It keeps KV of its own, one layer per draft layer, in the KV manager's draft pool: the pool
shares the target's allocator and row table, so a slot names the same position in both and the
draft's KV is allocated, accounted and freed with the request's (``SpecConfig(algorithm=
"draft_model")``, ``refengine/speculative/draft_model.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from refengine.memory.kv_pool import KVPool
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM


class StandaloneDraftModel(nn.Module):
    def __init__(self, lm: LlamaForCausalLM) -> None:
        super().__init__()
        self.lm = lm
        self.config = lm.config

    @property
    def kv_layers(self) -> int:
        """Layers of KV the draft pool needs."""
        return self.config.num_hidden_layers

    def forward(self, batch: ForwardBatch, kv: KVPool) -> ForwardOutput:
        return self.lm(batch, kv)

    @classmethod
    def load(cls, path: Path, target: LlamaForCausalLM, dtype: torch.dtype,
             device: str) -> StandaloneDraftModel:
        """Any Llama checkpoint (``check_model_dir`` checks it) whose tokens and KV layout are
        the target's: its tokens are verified by the target, and its KV lives in a pool laid
        out like the target's (same heads and head size per slot)."""
        lm = LlamaForCausalLM.load(path, dtype, device)
        cfg, tcfg = lm.config, target.config
        if cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{path}: draft vocabulary {cfg.vocab_size} does not match the "
                             f"target's {tcfg.vocab_size}")
        ours = (cfg.num_key_value_heads, cfg.head_dim)
        theirs = (tcfg.num_key_value_heads, tcfg.head_dim)
        if ours != theirs:
            raise ValueError(f"{path}: draft KV heads/head_dim {ours} do not match the target's "
                             f"{theirs} (the draft pool shares the target's slot layout)")
        return cls(lm)
