"""specgate's fixtures in the layout vLLM loads, written once into specgate's cache.

The target (``tiny-code``) and a standalone draft (``tiny-code-draft``) are plain HF Llama
directories that vLLM reads as they are. An EAGLE head says its layout in its config.json
(``refengine.model.configs.EagleLayout``): whether its one decoder layer has an input RMSNorm
and whether there is a final ``norm``. vLLM's EAGLE-1 Llama head (``EagleLlamaForCausalLM``,
``vllm/model_executor/models/llama_eagle.py``) has neither (its layer 0 input norm is an
identity and it returns the residual sum unnormalised).

- A head already in that layout (``tiny-code-eagle-vllm``) drafts in vLLM exactly as in
  refengine. Under vLLM's architecture name it is used as it is; under specgate's name (both
  norms declared absent) it is copied with the architecture renamed, nothing else.
- specgate's original head (``tiny-code-eagle``, both norms) is converted: the architecture
  renamed, ``layers.0.input_layernorm.weight`` and ``norm.weight`` dropped. This changes what
  the head drafts (so acceptance lengths differ from refengine's), never what is emitted:
  verification keeps greedy output lossless. ``drafts_as_refengine`` tells the two apart.
- An EAGLE-3 head (``tiny-code-eagle3``) is already in the layout vLLM's
  ``Eagle3LlamaForCausalLM`` loads (``vllm/model_executor/models/llama_eagle3.py``) and is used
  as it is. vLLM drafts with refengine's math unless its config.json turns on one of vLLM's
  EAGLE-3 variants, which refengine does not read (``eagle3_variants``).

Written under ``<cache>/vllm/<name>-<digest>`` (cache: ``$SPECGATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/specgate``, else ``~/.cache/specgate``; the digest covers every file of the
source directory and the conversion's version), into a temporary sibling renamed into place
whole, so concurrent xdist workers never read half a directory: the first rename wins.

Imports neither vLLM nor torch at module level (a conversion reads the bfloat16 tensors
with torch).
"""
from __future__ import annotations

import json
from pathlib import Path

from conformance.backends.converted import converted_once, files_digest
from refengine.model.configs import (
    EAGLE3_ARCHITECTURES,
    EAGLE_ARCHITECTURES,
    EagleLayout,
    architectures,
)

LAYOUT_VERSION = "vllm-layout-1"   # bump when the conversion changes
EAGLE_SOURCE_ARCH = "LlamaForCausalLMEagle"
EAGLE_VLLM_ARCH = "EagleLlamaForCausalLM"
EAGLE_DROPPED = ("layers.0.input_layernorm.weight", "norm.weight")
# What vLLM's Eagle3LlamaForCausalLM reads from a head's config.json and refengine's head does
# not (each changes the draft math away from the plain EAGLE-3 layer), with the value that
# leaves the math as refengine's: top-level keys, then keys of a nested ``eagle_config``.
EAGLE3_VARIANT_KEYS = {"norm_before_residual": False, "norm_output": False,
                       "norm_before_fc": False, "fc_norm": False}
EAGLE3_VARIANT_EAGLE_CONFIG = {"norm_before_fc": False, "use_aux_hidden_state": True}


def cache_root() -> Path:
    """specgate's cache directory (``refengine.graph.aot_format.cache_dir``) plus ``vllm``."""
    from refengine.graph.aot_format import cache_dir  # imports torch: only when converting

    return cache_dir() / "vllm"


def content_digest(source: Path) -> str:
    """sha256 over every file's name, size and bytes, with the layout version."""
    return files_digest(source, LAYOUT_VERSION, 24)


def _config(source: Path) -> dict:
    config = json.loads((source / "config.json").read_text())
    return config if isinstance(config, dict) else {}


def is_eagle_head(source: Path) -> bool:
    return bool(set(EAGLE_ARCHITECTURES) & set(architectures(_config(source))))


def head_layout(source: Path) -> EagleLayout:
    """The layout ``source``'s config.json declares (ValueError naming ``draft_model`` and
    the key if it is not one)."""
    try:
        return EagleLayout.from_dict(_config(source), source / "config.json")
    except ValueError as err:
        raise ValueError(f"draft_model: {err}") from None


def drafts_as_refengine(source: Path) -> bool:
    """Whether vLLM runs ``source``'s head with the same math as refengine: it has neither
    norm, so nothing is dropped on the way."""
    layout = head_layout(source)
    return not (layout.input_norm or layout.final_norm)


def eagle_dir(source: Path) -> Path:
    """``source`` (an EAGLE head) in vLLM's EAGLE-1 layout: itself when it already is, under
    vLLM's architecture name; else a converted copy, cached."""
    if not is_eagle_head(source):
        raise ValueError(f"draft_model: {source} is not an EAGLE head (config.json "
                         f"architectures must include one of {list(EAGLE_ARCHITECTURES)})")
    if EAGLE_VLLM_ARCH in architectures(_config(source)):
        head_layout(source)  # vLLM's name: the layout must agree (ValueError if not)
        return source
    return converted_once(cache_root() / f"{source.name}-{content_digest(source)}",
                          lambda staging: _convert_eagle(source, staging))


def _convert_eagle(source: Path, out: Path) -> None:
    from safetensors import safe_open  # torch: the fixtures store bfloat16, numpy has none
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    config["architectures"] = [EAGLE_VLLM_ARCH]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if name not in EAGLE_DROPPED:
                tensors[name] = f.get_tensor(name)
    missing = [n for n in ("fc.weight",) if n not in tensors]
    if missing:
        raise ValueError(f"draft_model: {source} lacks {missing}: not an EAGLE head")
    save_file(tensors, str(out / "model.safetensors"))


def eagle3_variants(source: Path) -> list[str]:
    """The keys of ``source``'s config.json that make vLLM draft with other math than
    refengine's EAGLE-3 head: a variant flag set (``EAGLE3_VARIANT_KEYS``, also under
    ``eagle_config``), or taps named only in ``eagle_config`` (vLLM reads them there when the
    top-level ``eagle_aux_hidden_state_layer_ids`` is absent; refengine takes its default)."""
    config = _config(source)
    nested = config.get("eagle_config")
    nested = nested if isinstance(nested, dict) else {}
    found = [key for key, plain in EAGLE3_VARIANT_KEYS.items() if config.get(key, plain) != plain]
    found += [f"eagle_config.{key}" for key, plain in EAGLE3_VARIANT_EAGLE_CONFIG.items()
              if nested.get(key, plain) != plain]
    taps = "eagle_aux_hidden_state_layer_ids"
    if not config.get(taps) and nested.get(taps):
        found.append(f"eagle_config.{taps}")
    return found


def eagle3_dir(source: Path) -> Path:
    """``source`` (an EAGLE-3 head) as vLLM loads it: itself, its layout already vLLM's."""
    if not set(EAGLE3_ARCHITECTURES) & set(architectures(_config(source))):
        raise ValueError(f"draft_model: {source} is not an EAGLE-3 head (config.json "
                         f"architectures must include one of {list(EAGLE3_ARCHITECTURES)})")
    return source
