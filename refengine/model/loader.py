"""Load an HF-format Llama directory: config.json, model.safetensors, tokenizer.json.

Only what the engine needs is read; every problem is reported as one line naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


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


def check_model_dir(path: Path) -> None:
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise FileNotFoundError(f"model directory {path} is missing {name}")


def load_config(path: Path) -> ModelConfig:
    source = path / "config.json"
    try:
        raw = json.loads(source.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON ({err})") from None
    return ModelConfig.from_dict(raw, source)


def load_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    source = path / "model.safetensors"
    try:
        tensors = load_file(str(source))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"corrupt safetensors file {source}: {err}") from None
    return {name: t.to(dtype) for name, t in tensors.items()}
