"""``OpenConfig`` as vLLM's ``EngineArgs``, and vLLM's refusals as the contract's one-line
``ValueError`` naming the field (docs/backends/vllm.md)."""

from __future__ import annotations

# vLLM's environment first: vLLM reads some of it when imported.
import conformance.backends.vllm.process  # noqa: F401

# isort: split

import contextlib
import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from vllm import EngineArgs

from conformance.backends.vllm.claims import NAME, TREE, UNCLAIMED_REASONS
from conformance.backends.vllm.layout import eagle3_dir, eagle_dir
from conformance.contract import OpenConfig
from refengine.data import resolve_model_dir
from specwire.params import NGRAM_MAX, NGRAM_MIN

# vLLM's CPU attention (CPU_ATTN) takes block sizes that are multiples of 32 only: a block
# size of 16 fails at start-up with "No common block size for 16 (CPU_ATTN:
# [MultipleOf(32)])" (measured), so the backend declares page_multiple=32. Unset page_size:
# 32, not vLLM's CPU default of 128, so the small pools the suite asks for keep many blocks.
CPU_BLOCK_MULTIPLE = 32
DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_RUNNING = 64  # the bundled backends' default (docs/adapter.md)

# The specgate field each vLLM config section's refusal comes from.
SECTION_FIELDS = {"ModelConfig": "model", "SpeculativeConfig": "spec",
                  "CacheConfig": "kv_pool_tokens", "SchedulerConfig": "max_running_requests"}


class SpeculativeSection(TypedDict, total=False):
    """vLLM's ``speculative_config`` as this backend fills it (no ``model`` for n-gram
    lookup, no prompt-lookup window for a draft model)."""

    method: str
    model: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int


@dataclass(frozen=True)
class ModelShape:
    """What the handle needs from the model's config.json."""

    vocab_size: int
    max_context_len: int


def block_size(cfg: OpenConfig) -> int:
    """``page_size`` as vLLM's block size: the default when unset; a positive multiple of 32
    (``page_multiple``, all the suite asks) as it is; anything else ``ValueError`` naming
    ``page_size``, since vLLM's CPU attention cannot run it."""
    if cfg.page_size is None:
        return DEFAULT_BLOCK_SIZE
    if cfg.page_size < 1 or cfg.page_size % CPU_BLOCK_MULTIPLE:
        raise ValueError(f"page_size: vLLM's CPU attention takes block sizes that are "
                         f"multiples of {CPU_BLOCK_MULTIPLE} only, not {cfg.page_size} "
                         f"(the backend declares page_multiple={CPU_BLOCK_MULTIPLE})")
    return cfg.page_size


def speculative_config(cfg: OpenConfig) -> SpeculativeSection | None:
    spec = cfg.spec
    if spec is None:
        return None
    if spec.overlap:
        raise ValueError("overlap: vLLM's CPU platform forces async scheduling off")
    if spec.topk != 1:
        raise ValueError(f"topk: {TREE} (got topk={spec.topk})")
    if spec.algorithm == "ngram":
        # No draft model: vLLM's prompt lookup over the same n-gram window as specgate's.
        return {"method": "ngram", "num_speculative_tokens": spec.num_steps,
                "prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}
    draft = resolve_model_dir(spec.draft_model)
    if spec.algorithm == "eagle":
        return {"method": "eagle", "model": str(eagle_dir(draft)),
                "num_speculative_tokens": spec.num_steps}
    if spec.algorithm == "eagle3":
        return {"method": "eagle3", "model": str(eagle3_dir(draft)),
                "num_speculative_tokens": spec.num_steps}
    if spec.algorithm == "draft_model":
        return {"method": "draft_model", "model": str(draft),
                "num_speculative_tokens": spec.num_steps}
    raise ValueError(f"algorithm: the {NAME} backend cannot run {spec.algorithm!r}: "
                     f"{UNCLAIMED_REASONS['algorithm:frozen_kv_mtp']}")


def one_line(err: BaseException, limit: int = 240) -> str:
    """``err`` as one line: its type and the start of its message."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def refusal(err: Exception, model_dir: str) -> ValueError:
    """A refusal by vLLM's config checks (``EngineArgs.create_engine_config``) as the
    contract's one-line ``ValueError`` naming the field. Its section refusals are pydantic
    ``ValidationError``s titled by the section (``ModelConfig``: an unknown architecture, a bad
    field); anything else there is about the model's files."""
    title = getattr(err, "title", None)
    field = SECTION_FIELDS.get(title, "model") if isinstance(title, str) else "model"
    errors = getattr(err, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            err = ValueError("; ".join(str(e.get("msg", "")) for e in errors()))
    return ValueError(f"{field}: vLLM refuses {model_dir}: {one_line(err)}")


def loading_model(err: BaseException) -> bool:
    """Whether ``err`` was raised while vLLM read the model's weights or tokenizer (frames in
    its model loader, its tokenizer code or transformers'), not elsewhere in engine start-up."""
    names = [frame.filename for frame in traceback.extract_tb(err.__traceback__)]
    return any(marker in name for name in names
               for marker in ("model_loader", "/vllm/tokenizers/", "/transformers/"))


def engine_args(cfg: OpenConfig) -> tuple[EngineArgs, ModelShape]:
    """``cfg`` as vLLM ``EngineArgs``, and the model's shape from its config.json."""
    if cfg.device != "cpu":
        raise ValueError(f"device: the {NAME} backend runs vLLM's CPU build only, "
                         f"not {cfg.device!r}")
    model_dir: Path = resolve_model_dir(cfg.model)
    config = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape(int(config["vocab_size"]), int(config["max_position_embeddings"]))
    size = block_size(cfg)
    max_seqs = cfg.max_running_requests or DEFAULT_MAX_RUNNING
    blocks_override = None  # vLLM's default: the pool it sizes itself
    max_model_len = shape.max_context_len
    if cfg.kv_pool_tokens is not None:
        # The pool in whole blocks, plus vLLM's reserved null block. vLLM refuses at start-up
        # a pool that cannot hold one request of max_model_len, so a smaller pool lowers
        # max_model_len to what it holds; a request that could reach that is refused at
        # submit (VllmHandle._check_pool), so none ends earlier than the model's limit would.
        blocks = max(1, -(-cfg.kv_pool_tokens // size))
        blocks_override = blocks + 1
        max_model_len = min(max_model_len, blocks * size)
    speculative = speculative_config(cfg)
    args = EngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype="float32", enforce_eager=True,
        max_model_len=max_model_len, seed=cfg.seed,
        block_size=size, max_num_seqs=max_seqs, enable_prefix_caching=False,
        # Whole prompts per step: vLLM discards the token sampled at a partial prefill and
        # then rewinds a seeded request's generator with set_offset, which CPU generators
        # refuse ("CPU Generator does not use offset"); chunked_prefill is not claimed.
        enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, max_seqs),
        disable_log_stats=True, num_gpu_blocks_override=blocks_override,
        speculative_config=None if speculative is None else dict(speculative))
    return args, shape
