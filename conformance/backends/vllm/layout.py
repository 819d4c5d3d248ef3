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
from refengine.model.configs import EAGLE_ARCHITECTURES, EagleLayout, architectures

LAYOUT_VERSION = "vllm-layout-1"   # bump when the conversion changes
EAGLE_SOURCE_ARCH = "LlamaForCausalLMEagle"
EAGLE_VLLM_ARCH = "EagleLlamaForCausalLM"
EAGLE_DROPPED = ("layers.0.input_layernorm.weight", "norm.weight")


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
