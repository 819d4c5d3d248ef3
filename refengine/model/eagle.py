"""The EAGLE draft head: ``fc`` over [embedding; feature], one decoder layer, a norm.

Checkpoint layout (``config.json`` with ``architectures: ["LlamaForCausalLMEagle"]``):
``fc.weight [H, 2H]``, ``layers.0.*`` (a Llama decoder layer, HF names), ``norm.weight``.
The token embedding, the LM head and the rotary tables are the target's (shared, not stored).

The two norms are the head's layout (``EagleLayout``, read from config.json): without
``eagle_input_norm`` the layer's attention reads ``fc``'s output as it is and
``layers.0.input_layernorm.weight`` is not stored; without ``eagle_final_norm`` the predicted
feature is the layer's output itself and ``norm.weight`` is not stored. vLLM's EAGLE-1 Llama
head (``architectures: ["EagleLlamaForCausalLM"]``) has neither. Every path that runs the head
(the eager forward and the graph runner's draft loops, both through ``compute``) runs the
modules built here, so all of them follow the layout.

Semantics: a row at position p takes the target's feature ``f_p`` (its final-norm output, what
the LM head reads) and the token ``x_{p+1}``, writes the draft's KV for position p, and predicts
``f_{p+1}``; the shared LM head turns that into the distribution of ``x_{p+2}``. During drafting
the head is fed its own predicted features.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from refengine.model.attention import AttentionMetadata
from refengine.model.configs import (
    EAGLE_ARCHITECTURE,
    EAGLE_ARCHITECTURES,
    EagleLayout,
    architectures,
)
from refengine.model.llama import (
    DecoderLayer,
    ForwardBatch,
    KVCache,
    LlamaForCausalLM,
    RMSNorm,
    Rotary,
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

__all__ = ["EAGLE_ARCHITECTURE", "EAGLE_ARCHITECTURES", "EagleDraftModel", "EagleLayout"]


class EagleDraftModel(nn.Module):
    def __init__(self, cfg: ModelConfig, target: LlamaForCausalLM,
                 layout: EagleLayout | None = None) -> None:
        """``layout``: which norms the head has (None: both, specgate's layout)."""
        super().__init__()
        layout = layout if layout is not None else EagleLayout()
        self.config, self.layout = cfg, layout
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, input_norm=layout.input_norm)])
        self.norm: nn.Module = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if layout.final_norm
                                else nn.Identity())
        # The target's embedding, LM head and rotary tables, set past nn.Module.__setattr__ so
        # they are not registered as submodules: they are the target's parameters, not part of
        # the head's state dict.
        object.__setattr__(self, "target_embed", target.model.embed_tokens)
        object.__setattr__(self, "target_lm_head", target.lm_head)
        object.__setattr__(self, "rotary", target.rotary)

    target_embed: nn.Embedding
    target_lm_head: nn.Linear
    rotary: Rotary

    @property
    def layer(self) -> DecoderLayer:
        """The head's one decoder layer (KV layer 0 of the draft pool)."""
        return self.layers[0]  # type: ignore[return-value]

    def fuse(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``fc`` over [embedding; feature], one row per token: the decoder layer's input."""
        return self.fc(torch.cat([self.target_embed(input_ids),
                                  features.to(self.fc.weight.dtype)], dim=-1))

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder-layer output -> (logits float32, predicted features): the final norm's
        output, or the layer's output itself in a layout without one."""
        predicted = self.norm(x)
        return self.target_lm_head(predicted).float(), predicted

    def compute(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attention: AttentionMetadata, slots: torch.Tensor, kv: KVCache,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head on plain tensors, without ``forward``'s inference-mode switch (which a
        compiled region cannot trace): what the eager forward and the draft loops' graphs both
        run. Every row writes its draft KV into ``slots``; the ``keep`` rows (all if None),
        whose queries ``attention`` covers, go on and are predicted from."""
        x = self.fuse(input_ids, features)
        x = self.layer(x, self.rotary.at(positions, x.dtype), attention, slots, kv, keep)
        return self.predict(x)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, features: torch.Tensor, kv: KVCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [wanted tokens, vocab] float32, predicted features [wanted tokens, H]).

        Every row writes its draft KV; with one layer, only the wanted rows (``logits_index``)
        need the rest of it: draft-extend and prefill want one row per request of several."""
        keep = batch.logits_index
        attention = batch.attention if keep is None else batch.attention.at_queries(keep)
        return self.compute(batch.input_ids, features, batch.positions, attention,
                            batch.out_slots, kv, keep)

    @classmethod
    def load(cls, path: Path, target: LlamaForCausalLM, dtype: torch.dtype,
             device: str) -> EagleDraftModel:
        require_files(path, DRAFT_FILES, "draft model")
        raw = read_config_json(path)
        if not set(EAGLE_ARCHITECTURES) & set(architectures(raw)):
            raise ValueError(f"{path / 'config.json'}: architectures must include one of "
                             f"{list(EAGLE_ARCHITECTURES)}, got {raw.get('architectures')}")
        cfg = ModelConfig.from_dict(raw, path / "config.json")
        layout = EagleLayout.from_dict(raw, path / "config.json")
        tcfg = target.config
        if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
            raise ValueError(f"{path}: draft hidden/vocab {cfg.hidden_size}/{cfg.vocab_size} do "
                             f"not match the target's {tcfg.hidden_size}/{tcfg.vocab_size}")
        model = build_loaded(path, lambda: cls(cfg, target, layout), load_weights(path, dtype),
                             f"not an EAGLE head of the layout config.json declares "
                             f"(input norm {layout.input_norm}, final norm {layout.final_norm})")
        return place_for_decoding(model, device)
