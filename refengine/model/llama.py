"""The Llama target (RMSNorm, RoPE, GQA, SwiGLU, untied head) over the paged KV cache.

Parameter names are HF's, so a checkpoint loads with a strict ``load_state_dict``; the math
follows HF's float32 path (RMSNorm in float32, rotate-half RoPE, SDPA with ``head_dim**-0.5``),
which is what lets the lossless tests compare token for token with ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from refengine.model.attention import AttentionMetadata, paged_attention
from refengine.model.loader import (
    ModelConfig,
    build_loaded,
    check_model_dir,
    load_config,
    load_weights,
)
from refengine.model.weight_layout import place_for_decoding

ROTARY_HEADROOM = 256


@dataclass
class ForwardBatch:
    """One forward's inputs: flat new tokens of every request, in request order."""

    input_ids: torch.Tensor        # [tokens]
    positions: torch.Tensor        # [tokens]
    out_slots: torch.Tensor        # [tokens] KV slot each new token writes
    attention: AttentionMetadata
    logits_index: torch.Tensor | None = None  # flat token indices whose logits are wanted
                                              # (None: every token)

    def wanted(self, features: torch.Tensor) -> torch.Tensor:
        return features if self.logits_index is None else features[self.logits_index]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary:
    """cos/sin tables for every position, computed once (HF's rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        # Computed on the CPU even where the model is built on the meta device (``load``);
        # ``place`` moves them where the model goes (they are not module state).
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                device="cpu").float() / head_dim)
        freqs = torch.arange(max_positions, device="cpu").float()[:, None] @ inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]           # [positions, 1, head_dim]
        self.cos, self.sin = emb.cos(), emb.sin()

    def place(self, device: str | torch.device) -> None:
        """Move the tables to ``device``, in place: the draft models share this object."""
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        """The tables at one forward's positions, gathered once for all its layers (a row
        gather: every forward of a speculative step pays it, up to four per step)."""
        return RopeAt(self.cos.index_select(0, positions).to(dtype),
                      self.sin.index_select(0, positions).to(dtype))


@dataclass
class RopeAt:
    cos: torch.Tensor  # [tokens, 1, head_dim]
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, the same math (``nn.Linear.forward``) without nn.Module's call machinery
    (hook and tracing checks, two more Python frames): at decode batch sizes that machinery is
    a good part of a linear's host cost, and a decoder layer has seven."""
    return F.linear(x, layer.weight, layer.bias)


class KVCache(Protocol):
    """Where a forward's decoder layers write their K and V and read them back: the pool
    (``KVPool``) when eager, a wrapper whose ``write`` is an opaque in-place op inside a
    compiled graph."""

    k: torch.Tensor  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None: ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, input_size: int | None = None) -> None:
        """``input_size``: the width q, k and v read (None: the hidden size; an EAGLE-3
        head's layer reads twice that)."""
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        width = input_size or cfg.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, rope: RopeAt
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input -> (q, k, v), q and k rotated: ``[tokens, heads, head_dim]``."""
        n = x.shape[0]
        q = rope.apply(linear(self.q_proj, x).view(n, self.heads, self.head_dim))
        k = rope.apply(linear(self.k_proj, x).view(n, self.kv_heads, self.head_dim))
        return q, k, linear(self.v_proj, x).view(n, self.kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               attention: AttentionMetadata) -> torch.Tensor:
        """Attention of ``q`` over one layer's cache, then the output projection."""
        out = paged_attention(q, k_cache, v_cache, attention, self.head_dim ** -0.5)
        return linear(self.o_proj, out.flatten(1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer. Its forward is ``project``, the KV write, ``finish``; a
    compiled graph may put the write between the two itself."""

    def __init__(self, cfg: ModelConfig, layer: int, input_norm: bool = True) -> None:
        """``input_norm=False``: the attention reads the layer's input as it is (an identity in
        place of ``input_layernorm``, no weight), as vLLM's EAGLE-1 head's layer 0 does."""
        super().__init__()
        self.input_layernorm: nn.Module = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
                                           if input_norm else nn.Identity())
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def project(self, x: torch.Tensor, rope: RopeAt
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer input -> (q, k, v) of every row, q and k rotated."""
        return self.self_attn.project(self.input_layernorm(x), rope)

    def finish(self, x: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, attention: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache (this forward's KV already written), the residual, the
        MLP: the layer's output for the rows of ``x`` and ``q``."""
        x = self.self_attn.attend(q, k_cache, v_cache, attention) + x
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, rope: RopeAt, attention: AttentionMetadata,
                slots: torch.Tensor, kv: KVCache, keep: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Every row writes its KV into ``slots``; the output has the ``keep`` rows only (all
        if None), and ``attention`` is that of their queries: the last layer of a stack needs
        no attention or MLP work for rows nobody reads."""
        q, k, v = self.project(x, rope)
        layer = self.self_attn.layer
        kv.write(layer, slots, k, v)
        if keep is not None:
            x, q = x.index_select(0, keep), q.index_select(0, keep)
        return self.finish(x, q, kv.k[layer], kv.v[layer], attention)


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor          # [wanted tokens, vocab], float32
    features: torch.Tensor        # [tokens, hidden]: what the drafter reads (``drafted``)
    # A verify graph's greedy walk over its tree, ``[requests, S + 3]``
    # (``kernels.tree_static``); None from every other forward.
    walk: torch.Tensor | None = None


class FeatureTap(Protocol):
    """A drafter's own features, taken in the target's forward: the residual stream at the
    input of each of ``layers`` (ascending; the stack's length names its output before the
    final norm), fused into one row per token (an EAGLE-3 head's ``fc``)."""

    layers: tuple[int, ...]

    def __call__(self, taps: list[torch.Tensor]) -> torch.Tensor: ...


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Speculative steps address up to num_draft_tokens positions past the context end
        # before the length check trims the run, so the table has head-room.
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings + ROTARY_HEADROOM,
                             cfg.rope_theta)
        self.feature_tap: FeatureTap | None = None

    def use_feature_tap(self, tap: FeatureTap | None) -> None:
        """Hand the drafter ``tap``'s features instead of the final-norm ones (None: those).
        Kept past nn.Module.__setattr__: the tap's weights are the draft's, not the target's."""
        object.__setattr__(self, "feature_tap", tap)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, RopeAt]:
        """The first decoder layer's input and the rotary tables at ``positions``."""
        x = self.model.embed_tokens(input_ids)
        return x, self.rotary.at(positions, x.dtype)

    def features(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attention: AttentionMetadata, slots: torch.Tensor, kv: KVCache
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, every decoder layer (each writing its KV into ``slots``), final norm ->
        (the features the LM head reads, the features the drafter reads: the same, or the
        ``feature_tap``'s), one row per token. Not in inference mode itself, so a compiled
        graph can trace it."""
        x, rope = self.embed(input_ids, positions)
        tap, taps = self.feature_tap, []
        for i, layer in enumerate(self.model.layers):
            if tap is not None and i in tap.layers:
                taps.append(x)
            x = layer(x, rope, attention, slots, kv)
        normed = self.model.norm(x)
        if tap is None:
            return normed, normed
        if len(self.model.layers) in tap.layers:
            taps.append(x)
        return normed, tap(taps)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The LM head, in float32."""
        return self.lm_head(features).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> ForwardOutput:
        normed, drafted = self.features(batch.input_ids, batch.positions, batch.attention,
                                        batch.out_slots, kv)
        return ForwardOutput(self.logits(batch.wanted(normed)), drafted)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
        check_model_dir(path)
        cfg = load_config(path)
        weights = load_weights(path, dtype)
        if cfg.tie_word_embeddings and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model = build_loaded(path, lambda: cls(cfg), weights, "weights do not match config.json")
        model.rotary.place(device)
        return place_for_decoding(model, device)
