"""The Frozen-KV MTP assistant: a small recurrent draft network that reads the target's KV.

The assistant owns no KV cache. Each of its decoder layers has query-only attention: it projects
a query, rotates it with the target's rotary tables and attends over the K and V that the
target's layer ``kv_layer`` (its last one) already wrote for the request's committed prefix.
Nothing the assistant computes is ever written to the pool, so drafting needs no draft KV slots,
no draft-extend pass and no rollback: the committed target KV is all the state there is.

One iteration, per row (target width ``H``, assistant width ``d``):

    e      = target.embed_tokens(x) * sqrt(H)          # the target's embedding, shared
    z      = pre_projection([e; h])                     # 2H -> d
    z      = z + o_proj(attn(rope(q_proj(norm(z))), K_target, V_target))   # x num_hidden_layers
    z      = z + mlp(norm(z))                           #   (pre-norm, SwiGLU)
    h_next = post_projection(norm(z))                   # d -> H: the recurrent state
    logits = lm_head(h_next)                            # the assistant's own head, H -> vocab

``h`` is the target's final-norm feature (what its LM head reads) at the position that produced
``x`` for the first iteration of a decode step, and the assistant's own ``h_next`` after that.
Every iteration of one step queries from the same position ``p = seq_len - 1`` (``seq_len``: the
request's committed KV length) and sees exactly the positions ``[0, seq_len)``: the drafted
tokens have no KV, so what the assistant knows about them travels through ``h`` alone.

Checkpoint layout (``config.json`` with ``architectures: ["FrozenKVMTPAssistant"]``):
``pre_projection.weight [d, 2H]``, ``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q_proj,o_proj}.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight``, ``norm.weight``,
``post_projection.weight [H, d]``, ``lm_head.weight [vocab, H]``. The token embedding and the
rotary tables are the target's (shared, not stored); the query heads and head size are the
target's, since the queries meet the target's keys.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from refengine.model.attention import AttentionMetadata, paged_attention
from refengine.model.configs import MTP_ARCHITECTURE, FrozenKVMTPConfig
from refengine.model.llama import KVCache, LlamaForCausalLM, RMSNorm, RopeAt, Rotary, SwiGLU
from refengine.model.loader import (
    DRAFT_FILES,
    build_loaded,
    load_weights,
    read_config_json,
    require_files,
)
from refengine.model.weight_layout import place_for_decoding


class QueryOnlyAttention(nn.Module):
    """Attention whose keys and values are someone else's: a query and an output projection,
    no ``k_proj``/``v_proj``, and no KV write."""

    def __init__(self, cfg: FrozenKVMTPConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: RopeAt, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attention: AttentionMetadata) -> torch.Tensor:
        q = rope.apply(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim))
        # The pool's keys were rotated at their own positions when the target wrote them, so a
        # query rotated at its position gives the usual relative-position scores.
        out = paged_attention(q, k_cache, v_cache, attention, self.head_dim ** -0.5)
        return self.o_proj(out.flatten(1))


class MTPLayer(nn.Module):
    """A pre-norm decoder layer at the assistant's width with query-only attention."""

    def __init__(self, cfg: FrozenKVMTPConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QueryOnlyAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: RopeAt, k_cache: torch.Tensor,
                v_cache: torch.Tensor, attention: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class FrozenKVMTPDraftModel(nn.Module):
    def __init__(self, cfg: FrozenKVMTPConfig, target: LlamaForCausalLM) -> None:
        super().__init__()
        self.config = cfg
        self.pre_projection = nn.Linear(2 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.target_hidden_size, bias=False)
        self.lm_head = nn.Linear(cfg.target_hidden_size, cfg.vocab_size, bias=False)
        self.embed_scale = math.sqrt(cfg.target_hidden_size)
        # The target's embedding and rotary tables, set past nn.Module.__setattr__ so they are
        # not registered as submodules: they are the target's parameters, not part of the
        # assistant's state dict.
        object.__setattr__(self, "target_embed", target.model.embed_tokens)
        object.__setattr__(self, "rotary", target.rotary)

    target_embed: nn.Embedding
    rotary: Rotary

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``compute`` in inference mode."""
        return self.compute(input_ids, hidden, positions, attention, kv)

    def compute(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting iteration for n rows -> (logits [n, vocab] float32, next hidden [n, H]),
        without ``forward``'s inference-mode switch (which a compiled region cannot trace):
        what the eager forward and the draft loop's graph both run.

        ``input_ids`` [n]: each row's token; ``hidden`` [n, H]: the target's feature at the
        position that produced it (first iteration) or the previous ``next hidden``;
        ``positions`` [n]: ``seq_len - 1``; ``attention``: one query per row over the committed
        ``[0, seq_len)`` (``AttentionMetadata.build`` with extend length 1 and ``seq_len``,
        which must be at least 1). ``kv`` is read, never written.
        """
        embedded = self.target_embed(input_ids) * self.embed_scale
        x = self.pre_projection(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1))
        rope = self.rotary.at(positions, x.dtype)
        layer = self.config.kv_layer
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        for block in self.layers:
            x = block(x, rope, k_cache, v_cache, attention)
        h_next = self.post_projection(self.norm(x))
        return self.lm_head(h_next).float(), h_next

    @classmethod
    def load(cls, path: Path, target: LlamaForCausalLM, dtype: torch.dtype,
             device: str) -> FrozenKVMTPDraftModel:
        require_files(path, DRAFT_FILES, "draft model")
        source = path / "config.json"
        raw = read_config_json(path)
        if MTP_ARCHITECTURE not in raw.get("architectures", []):
            raise ValueError(f"{source}: architectures must include {MTP_ARCHITECTURE!r}, "
                             f"got {raw.get('architectures')}")
        cfg = FrozenKVMTPConfig.from_dict(raw, source)
        _check_against_target(path, cfg, target)
        model = build_loaded(path, lambda: cls(cfg, target), load_weights(path, dtype),
                             "not a Frozen-KV MTP assistant for config.json")
        return place_for_decoding(model, device)


def _check_against_target(path: Path, cfg: FrozenKVMTPConfig, target: LlamaForCausalLM) -> None:
    """The assistant reads the target's embedding, features and KV: every size they share must
    agree, or the forward would fail (or worse, silently read the wrong layer)."""
    tcfg = target.config
    if (cfg.target_hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(f"{path}: assistant target width/vocab {cfg.target_hidden_size}/"
                         f"{cfg.vocab_size} do not match the target's "
                         f"{tcfg.hidden_size}/{tcfg.vocab_size}")
    ours = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    theirs = (tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim)
    if ours != theirs:
        raise ValueError(f"{path}: assistant heads/KV heads/head_dim {ours} do not match the "
                         f"target's {theirs}")
    if not 0 <= cfg.kv_layer < tcfg.num_hidden_layers:
        raise ValueError(f"{path}: kv_layer {cfg.kv_layer} is not a layer of the target "
                         f"(it has {tcfg.num_hidden_layers})")
