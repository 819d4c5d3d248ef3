"""An HF Llama directory converted to a CTranslate2 model once, into a cache shared by every
process (pytest-xdist workers open the backend at the same time).

The cache key is the directory's content (every file's name and bytes) with the CTranslate2
version and compute type, so a changed weight, config or tokenizer, or a new CTranslate2,
converts again. A conversion is written to a temporary sibling directory and renamed into
place whole: a reader sees no directory or a complete one, and when two processes race, the
first rename wins and the other discards its copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import ctranslate2

from conformance.backends.converted import converted_once, files_digest

CACHE_ENV = "SPECGATE_CACHE"   # the cache root; default $XDG_CACHE_HOME/specgate or ~/.cache/...
COMPUTE_TYPE = "float32"       # what refengine computes in, so greedy outputs can be compared


def cache_root() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base) / "ctranslate2"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specgate" / "ctranslate2"


def content_key(source: Path) -> str:
    return files_digest(source, f"ctranslate2 {ctranslate2.__version__} {COMPUTE_TYPE}", 32)


def converted_model_dir(source: Path) -> Path:
    """The CTranslate2 model of ``source`` (an HF directory), converting it on first use."""
    return converted_once(cache_root() / content_key(source),
                          lambda staging: _convert(source, staging))


def _convert(source: Path, out: Path) -> None:
    import transformers  # only a conversion needs it (seconds to import)
    from ctranslate2.converters import TransformersConverter

    transformers.utils.logging.disable_progress_bar()  # a loading bar per conversion is noise
    TransformersConverter(str(source), low_cpu_mem_usage=True).convert(
        str(out), quantization=COMPUTE_TYPE, force=True)
