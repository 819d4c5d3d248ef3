"""The hyper-parameters of the models the engine loads, read from their config.json (HF names):
the Llama target (also an EAGLE head's layer and a standalone draft model) and the Frozen-KV
MTP assistant. Parsing only; ``loader`` reads the files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    """The Llama hyper-parameters the forward pass needs (HF config.json names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    eos_token_id: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, raw: dict, source: Path) -> ModelConfig:
        if raw.get("model_type") != "llama":
            raise ValueError(f"{source}: model_type must be 'llama', got {raw.get('model_type')!r}")
        try:
            heads = int(raw["num_attention_heads"])
            rope = raw.get("rope_parameters") or {}
            eos = raw.get("eos_token_id", 0)
            return cls(
                vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                rms_norm_eps=float(raw["rms_norm_eps"]),
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
        except KeyError as missing:
            raise ValueError(f"{source}: missing field {missing}") from None
        except (TypeError, ValueError) as err:  # e.g. "hidden_size": null or "x"
            raise ValueError(f"{source}: bad field value ({err})") from None


MTP_ARCHITECTURE = "FrozenKVMTPAssistant"
MTP_MODEL_TYPE = "frozen_kv_mtp"


@dataclass(frozen=True)
class FrozenKVMTPConfig:
    """The assistant's hyper-parameters (its config.json names)."""

    hidden_size: int            # d, the trunk's width
    target_hidden_size: int     # H, the width of the features it reads and predicts
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int    # query heads, the target's count
    num_key_value_heads: int    # the target's KV heads (GQA over its cache)
    head_dim: int
    kv_layer: int               # the target layer whose K and V every layer attends over
    vocab_size: int
    rms_norm_eps: float

    @classmethod
    def from_dict(cls, raw: dict, source: Path) -> FrozenKVMTPConfig:
        if raw.get("model_type") != MTP_MODEL_TYPE:
            raise ValueError(f"{source}: model_type must be {MTP_MODEL_TYPE!r}, "
                             f"got {raw.get('model_type')!r}")
        try:
            return cls(
                hidden_size=int(raw["hidden_size"]),
                target_hidden_size=int(raw["target_hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                num_key_value_heads=int(raw["num_key_value_heads"]),
                head_dim=int(raw["head_dim"]), kv_layer=int(raw["kv_layer"]),
                vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw["rms_norm_eps"]))
        except KeyError as missing:
            raise ValueError(f"{source}: missing field {missing}") from None
        except (TypeError, ValueError) as err:  # e.g. "hidden_size": null or "x"
            raise ValueError(f"{source}: bad field value ({err})") from None
