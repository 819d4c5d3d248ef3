"""Validated configuration dataclasses: SamplingParams, SpecConfig, EngineConfig.

Every bad value raises ``ValueError`` whose message starts with the offending field's name, so
the CLI can print it as one line and callers can tell which knob to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GRAPH_EXECUTORS = ("compiled", "frozen", "replay")  # EngineConfig.graph_executor's values
SPEC_ALGORITHMS = ("eagle", "frozen_kv_mtp", "draft_model")  # SpecConfig.algorithm's values


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    # bool is an int subclass; True as a temperature is a caller bug, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(value: object, name: str) -> tuple[object, ...]:
    """Accept any iterable from callers but store a tuple (hashable, immutable). A non-iterable
    (None, a bare int) is a bad value of ``name``, reported as ValueError, not a TypeError."""
    try:
        return tuple(value)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name}: must be a sequence, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # None: derived from the engine seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the emitted text is cut before the match
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids",
                           _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                           else _as_tuple(self.stop, "stop"))
        _require(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                 "max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        _require(_is_number(self.temperature) and math.isfinite(self.temperature)
                 and self.temperature >= 0, "temperature",
                 f"must be a finite number >= 0, got {self.temperature!r}")
        _require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                 f"must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        _require(self.seed is None or (_is_int(self.seed) and self.seed >= 0), "seed",
                 f"must be None or an integer >= 0, got {self.seed!r}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"must be non-negative integers, got {self.stop_token_ids!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"must be non-empty strings, got {self.stop!r}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos",
                 f"must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (sglang's names).

    ``num_draft_tokens`` counts the tree's nodes including the root (the last verified token);
    a chain (``topk == 1``) therefore needs ``num_draft_tokens == num_steps + 1``.
    ``algorithm="draft_model"`` (a standalone draft LM, e.g. ``tiny-code-draft``) drafts such a
    chain of ``num_steps`` tokens and runs sequentially (no overlap scheduling).
    """

    algorithm: Literal["eagle", "frozen_kv_mtp", "draft_model"] = "eagle"
    draft_model: str = "tiny-code-eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    overlap: bool = False

    def __post_init__(self) -> None:
        _require(self.algorithm in SPEC_ALGORITHMS, "algorithm",
                 f"must be one of {', '.join(SPEC_ALGORITHMS)}, got {self.algorithm!r}")
        _require(isinstance(self.draft_model, str) and bool(self.draft_model), "draft_model",
                 f"must be a fixture name or a directory, got {self.draft_model!r}")
        _require(_is_int(self.num_steps) and self.num_steps >= 1, "num_steps",
                 f"must be an integer >= 1, got {self.num_steps!r}")
        _require(_is_int(self.topk) and self.topk >= 1, "topk",
                 f"must be an integer >= 1, got {self.topk!r}")
        _require(_is_int(self.num_draft_tokens) and self.num_draft_tokens >= 2,
                 "num_draft_tokens", f"must be an integer >= 2, got {self.num_draft_tokens!r}")
        if self.topk == 1:
            _require(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                     f"a chain (topk=1) needs num_steps + 1 = {self.num_steps + 1}, "
                     f"got {self.num_draft_tokens}")
        else:
            most = 1 + self.topk * self.num_steps
            _require(self.num_draft_tokens <= most, "num_draft_tokens",
                     f"at most 1 + topk * num_steps = {most} for this tree, "
                     f"got {self.num_draft_tokens}")
        _require(isinstance(self.overlap, bool), "overlap",
                 f"must be a bool, got {self.overlap!r}")
        if self.algorithm == "draft_model":
            _require(self.topk == 1, "topk",
                     f"draft_model speculation drafts a chain (topk=1), got {self.topk}")
            _require(not self.overlap, "overlap",
                     "draft_model speculation runs sequentially; overlap scheduling is "
                     "not supported")


@dataclass(frozen=True)
class EngineConfig:
    """Engine construction parameters; ``model`` is a fixture name or an HF-format directory."""

    model: str = "tiny-code"
    spec: SpecConfig | None = None
    kv_pool_tokens: int = 16384
    page_size: int = 1
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # per-step token budget; longer prompts prefill in chunks
    device: str = "cpu"
    dtype: str = "float32"
    strict_mem_check: bool = True
    # Target decode and verify forwards through the graph runner (refengine/graph/): staged on
    # static bucket-padded buffers and run by ``graph_executor``: "compiled" (torch.compile
    # per key, what makes a CPU engine faster; first use of a key compiles it, once per
    # machine thanks to inductor's cache), "frozen" (the same with the weights folded into
    # each key: faster still, but every process compiles each key again) or "replay"
    # (the captured callable run eagerly on the static buffers: staging and padding under test,
    # no speed-up).
    cuda_graph: bool = False
    graph_executor: Literal["compiled", "frozen", "replay"] = "compiled"
    seed: int = 0
    retract_every: int = 0  # test hook: retract the middle decoding request every N decode steps
    # Overlap scheduling (SpecConfig(overlap=True)): run each decode step's forwards on a worker
    # thread while the previous step is resolved. False: the same one-step-late order in one
    # thread (deterministic mode, for tests). Both give the same tokens.
    overlap_thread: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and bool(self.model), "model",
                 f"must be a fixture name or a directory, got {self.model!r}")
        _require(_is_int(self.page_size) and self.page_size >= 1, "page_size",
                 f"must be an integer >= 1, got {self.page_size!r}")
        _require(_is_int(self.kv_pool_tokens) and self.kv_pool_tokens >= self.page_size,
                 "kv_pool_tokens", f"must be an integer >= page_size ({self.page_size}), "
                 f"got {self.kv_pool_tokens!r}")
        _require(_is_int(self.max_running_requests) and self.max_running_requests >= 1,
                 "max_running_requests", f"must be an integer >= 1, got "
                 f"{self.max_running_requests!r}")
        _require(_is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1,
                 "max_prefill_tokens", f"must be an integer >= 1, got {self.max_prefill_tokens!r}")
        _require(isinstance(self.device, str)
                 and (self.device == "cpu" or self.device.startswith("cuda")), "device",
                 f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
                 f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        _require(isinstance(self.strict_mem_check, bool), "strict_mem_check",
                 f"must be a bool, got {self.strict_mem_check!r}")
        _require(_is_int(self.seed) and self.seed >= 0, "seed",
                 f"must be an integer >= 0, got {self.seed!r}")
        _require(_is_int(self.retract_every) and self.retract_every >= 0, "retract_every",
                 f"must be an integer >= 0 (0 = off), got {self.retract_every!r}")
        _require(isinstance(self.overlap_thread, bool), "overlap_thread",
                 f"must be a bool, got {self.overlap_thread!r}")
        _require(isinstance(self.cuda_graph, bool), "cuda_graph",
                 f"must be a bool, got {self.cuda_graph!r}")
        _require(self.graph_executor in GRAPH_EXECUTORS, "graph_executor",
                 f"must be one of {', '.join(GRAPH_EXECUTORS)}, got {self.graph_executor!r}")
