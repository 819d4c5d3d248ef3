"""The hyper-parameters of the models the engine loads, read from their config.json (HF names):
the Llama target (also an EAGLE head's layer and a standalone draft model), an EAGLE head's
layout, an EAGLE-3 head's taps and vocabulary, and the Frozen-KV MTP assistant. Parsing only;
``loader`` reads the files."""

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


EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"  # specgate's head: both norms unless config says
EAGLE_VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"  # vLLM's EAGLE-1 Llama head: neither norm
EAGLE_ARCHITECTURES = (EAGLE_ARCHITECTURE, EAGLE_VLLM_ARCHITECTURE)
EAGLE_NORM_KEYS = {"input_norm": "eagle_input_norm", "final_norm": "eagle_final_norm"}
EAGLE_NORM_WEIGHTS = {"input_norm": "layers.0.input_layernorm.weight",
                      "final_norm": "norm.weight"}


def architectures(raw: dict) -> list[str]:
    """config.json's ``architectures`` as a list of names ([] when absent or not a list)."""
    names = raw.get("architectures")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


@dataclass(frozen=True)
class EagleLayout:
    """Which RMSNorms an EAGLE head has around its one decoder layer.

    specgate's layout (``LlamaForCausalLMEagle``, the default) normalises the layer's input and
    its output (the predicted feature). vLLM's EAGLE-1 Llama head (``EagleLlamaForCausalLM``)
    has neither: layer 0 reads ``fc``'s output as it is and the head returns the residual sum,
    which the LM head reads and the next draft step is fed. config.json says which with
    ``eagle_input_norm`` / ``eagle_final_norm`` (booleans; defaults: true, or false under
    vLLM's architecture, which cannot have them). A norm that is absent stores no weight.
    """

    input_norm: bool = True
    final_norm: bool = True

    @property
    def norm_weights(self) -> dict[str, bool]:
        """Each norm's weight name in the checkpoint -> whether this layout stores it."""
        return {EAGLE_NORM_WEIGHTS[field]: getattr(self, field) for field in EAGLE_NORM_WEIGHTS}

    @classmethod
    def from_dict(cls, raw: dict, source: Path) -> EagleLayout:
        vllm = EAGLE_VLLM_ARCHITECTURE in architectures(raw)
        flags: dict[str, bool] = {}
        for field, key in EAGLE_NORM_KEYS.items():
            value = raw.get(key, not vllm)
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
            if vllm and value:
                raise ValueError(f"{source}: {key} is true, but architecture "
                                 f"{EAGLE_VLLM_ARCHITECTURE!r} (vLLM's EAGLE-1 layout) has no "
                                 "such norm")
            flags[field] = value
        return cls(**flags)


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the EAGLE-3 head as vLLM and sglang load it
EAGLE3_ARCHITECTURES = (EAGLE3_ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM's class name too


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head adds to its Llama layer's config.json: the target layers whose
    input (the residual stream there) it reads, and its draft vocabulary's size.

    ``eagle_aux_hidden_state_layer_ids``: distinct layer indices in ``[0, target layers]``
    (``L`` reads the stream after the last layer, before the final norm); the head fuses them
    in ascending order whatever order config.json lists, as vLLM collects them. Absent, the
    layers vLLM picks by default: ``(2, L // 2, L - 3)``. ``draft_vocab_size`` absent: the
    target's vocabulary."""

    aux_layers: tuple[int, ...]
    draft_vocab_size: int

    @classmethod
    def from_dict(cls, raw: dict, source: Path, target_layers: int, vocab_size: int
                  ) -> Eagle3Config:
        layers = raw.get("eagle_aux_hidden_state_layer_ids")
        if layers is None:
            layers = [2, target_layers // 2, target_layers - 3]
        if (not isinstance(layers, list) or not layers
                or not all(type(i) is int and 0 <= i <= target_layers for i in layers)
                or len(set(layers)) != len(layers)):
            raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids must be distinct "
                             f"layer indices in [0, {target_layers}], got {layers!r}")
        size = raw.get("draft_vocab_size", vocab_size)
        if type(size) is not int or not 1 <= size <= vocab_size:
            raise ValueError(f"{source}: draft_vocab_size must be an integer in [1, "
                             f"{vocab_size}] (the target's vocabulary), got {size!r}")
        return cls(tuple(sorted(layers)), size)


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
