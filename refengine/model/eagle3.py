"""The EAGLE-3 draft head, in the checkpoint layout vLLM and sglang load.

Checkpoint (``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``,
``eagle_aux_hidden_state_layer_ids``, ``draft_vocab_size``): ``fc.weight [H, aH]`` (``a`` taps),
``midlayer.*`` (a Llama decoder layer whose q/k/v read ``2H``, plus ``midlayer.hidden_norm``),
``norm.weight``, ``lm_head.weight [V_d, H]``, ``d2t [V_d]`` (each draft id's offset to its
target id) and ``t2d [V]`` (which target ids the draft vocabulary has). The token embedding and
the rotary tables are the target's (shared, not stored).

Semantics, where they differ from the EAGLE-1 head (``eagle.py``):

* features: the target's residual stream at the input of each tap layer, concatenated in layer
  order and projected by ``fc``, computed in the target's own forward (``FeatureTap``: the
  target hands these to its drafter in place of its final-norm features, without a second
  forward);
* the layer normalises the token embedding (``input_layernorm``) and the feature
  (``hidden_norm``) apart and attends over their concatenation ``[embedding; feature]``; the
  residual is the feature;
* the predicted feature is the layer's output before the final norm (what the next draft step
  is fed); the norm's output goes through the head's own LM head over the draft vocabulary,
  whose logits land on the target ids ``d2t`` names, every other id at ``-inf``.

Row and position semantics are EAGLE-1's: a row at position p takes the feature of p and the
token ``x_{p+1}``, writes the head's KV for position p and predicts ``x_{p+2}``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from refengine.model.attention import AttentionMetadata
from refengine.model.configs import EAGLE3_ARCHITECTURES, Eagle3Config, architectures
from refengine.model.eagle import EagleDraftModel
from refengine.model.llama import (
    Attention,
    ForwardBatch,
    KVCache,
    LlamaForCausalLM,
    RMSNorm,
    RopeAt,
    Rotary,
    SwiGLU,
)
from refengine.model.loader import (
    DRAFT_FILES,
    ModelConfig,
    build_loaded,
    load_weights,
    read_config_json,
    require_files,
)
from refengine.model.weight_layout import place_for_decoding

__all__ = ["EAGLE3_ARCHITECTURES", "AuxFeatureTap", "Eagle3DraftModel", "EagleHead"]


class AuxFeatureTap(nn.Module):
    """The target's features for an EAGLE-3 head: the residual stream at each of ``layers``
    (ascending), concatenated in that order and projected by the head's ``fc``."""

    def __init__(self, layers: tuple[int, ...], fc: nn.Linear) -> None:
        super().__init__()
        self.layers = layers
        self.fc = fc

    def forward(self, taps: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(taps, dim=-1))


class Eagle3Layer(nn.Module):
    """The head's one decoder layer over ``[input_layernorm(embedding); hidden_norm(feature)]``
    (2H wide), its residual the feature."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def doubled_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention's input: the normed embedding, then the normed feature."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RopeAt,
                attention: AttentionMetadata, slots: torch.Tensor, kv: KVCache,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every row writes its KV into ``slots``; the output has the ``keep`` rows only (all
        if None), whose queries ``attention`` covers."""
        q, k, v = self.self_attn.project(self.doubled_input(embeds, hidden), rope)
        kv.write(0, slots, k, v)
        if keep is not None:
            hidden, q = hidden.index_select(0, keep), q.index_select(0, keep)
        x = self.self_attn.attend(q, kv.k[0], kv.v[0], attention) + hidden
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3DraftModel(nn.Module):
    def __init__(self, cfg: ModelConfig, eagle3: Eagle3Config, target: LlamaForCausalLM
                 ) -> None:
        super().__init__()
        self.config, self.eagle3 = cfg, eagle3
        h = cfg.hidden_size
        self.fc = nn.Linear(len(eagle3.aux_layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, eagle3.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(eagle3.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # The target's embedding and rotary tables, and the tap the target runs with this
        # head's fc, set past nn.Module.__setattr__: not part of the head's state dict.
        object.__setattr__(self, "target_embed", target.model.embed_tokens)
        object.__setattr__(self, "rotary", target.rotary)
        object.__setattr__(self, "tap", AuxFeatureTap(eagle3.aux_layers, self.fc))

    target_embed: nn.Embedding
    rotary: Rotary
    tap: AuxFeatureTap
    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def layers(self) -> list[Eagle3Layer]:
        """The layers that keep KV in the draft pool: the one midlayer (KV layer 0)."""
        return [self.midlayer]

    def target_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Layer output -> float32 logits over the target's vocabulary: the draft vocabulary's
        at the target ids ``d2t`` maps them to, ``-inf`` at every other id."""
        logits = self.lm_head(self.norm(x)).float()
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        ids = torch.arange(self.eagle3.draft_vocab_size, device=logits.device) + self.d2t
        return full.index_copy_(1, ids, logits)

    def compute(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, slots: torch.Tensor, kv: KVCache,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head on plain tensors (``EagleDraftModel.compute``'s contract): ``features``
        are the target's fused ones (prefill, extend) or the head's own predicted ones (draft
        steps) -> (logits over the target's vocabulary, predicted features: the layer's
        output before the final norm)."""
        x = self.midlayer(self.target_embed(input_ids), features.to(self.fc.weight.dtype),
                          self.rotary.at(positions, self.fc.weight.dtype), attention, slots,
                          kv, keep)
        return self.target_logits(x), x

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, features: torch.Tensor, kv: KVCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``EagleDraftModel.forward``'s contract: every row writes its draft KV, the wanted
        rows (``logits_index``) go on."""
        keep = batch.logits_index
        attention = batch.attention if keep is None else batch.attention.at_queries(keep)
        return self.compute(batch.input_ids, features, batch.positions, attention,
                            batch.out_slots, kv, keep)

    @classmethod
    def load(cls, path: Path, target: LlamaForCausalLM, dtype: torch.dtype,
             device: str) -> Eagle3DraftModel:
        require_files(path, DRAFT_FILES, "draft model")
        raw = read_config_json(path)
        source = path / "config.json"
        if not set(EAGLE3_ARCHITECTURES) & set(architectures(raw)):
            raise ValueError(f"{source}: architectures must include one of "
                             f"{list(EAGLE3_ARCHITECTURES)}, got {raw.get('architectures')}")
        cfg = ModelConfig.from_dict(raw, source)
        tcfg = target.config
        if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
            raise ValueError(f"{path}: draft hidden/vocab {cfg.hidden_size}/{cfg.vocab_size} do "
                             f"not match the target's {tcfg.hidden_size}/{tcfg.vocab_size}")
        eagle3 = Eagle3Config.from_dict(raw, source, tcfg.num_hidden_layers, tcfg.vocab_size)
        weights = load_weights(path, dtype)
        model = build_loaded(path, lambda: cls(cfg, eagle3, target), weights,
                             "not an EAGLE-3 head of the shape config.json declares "
                             f"({len(eagle3.aux_layers)} taps, draft vocabulary "
                             f"{eagle3.draft_vocab_size})")
        check_vocabulary_map(path, weights["d2t"], weights["t2d"], cfg.vocab_size)
        return place_for_decoding(model, device)


def check_vocabulary_map(path: Path, d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> None:
    """A one-line ValueError unless ``d2t`` maps the draft ids to distinct target ids in
    ``[0, vocab)`` and ``t2d`` marks exactly those: a damaged map would draft tokens the head
    never scored (outputs stay lossless, acceptance silently drops)."""
    where = path / "model.safetensors"
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"{where}: d2t must be int64 and t2d bool, got {d2t.dtype} and "
                         f"{t2d.dtype}")
    ids = torch.arange(len(d2t)) + d2t
    if bool(((ids < 0) | (ids >= vocab)).any()) or len(torch.unique(ids)) != len(ids):
        raise ValueError(f"{where}: d2t maps draft ids outside [0, {vocab}) or two onto one "
                         "target id")
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d):
        raise ValueError(f"{where}: t2d marks {int(t2d.sum())} target ids, not the "
                         f"{len(ids)} d2t maps to")


EagleHead = EagleDraftModel | Eagle3DraftModel  # the heads that keep KV and share EAGLE's drafter
