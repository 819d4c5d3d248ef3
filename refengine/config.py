"""Validated configuration dataclasses: EngineConfig, and the wire types SamplingParams and
SpecConfig (defined in ``specwire``, shared with the conformance contract).

Every bad value raises ``ValueError`` whose message starts with the offending field's name, so
the CLI can print it as one line and callers can tell which knob to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.graph.executors import EXECUTORS, default_executor, executor_names
from specwire.params import (
    NGRAM_MAX,
    NGRAM_MIN,
    SPEC_ALGORITHMS,
    SamplingParams,
    SpecConfig,
    is_int,
    require,
)

__all__ = ["GRAPH_EXECUTORS", "NGRAM_MAX", "NGRAM_MIN", "SPEC_ALGORITHMS", "EngineConfig",
           "SamplingParams", "SpecConfig"]

GRAPH_EXECUTORS = executor_names()  # EngineConfig.graph_executor's (the executor registry's)


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
    # Target decode and verify forwards (and the draft loops) through the graph runner
    # (refengine/graph/): staged on static bucket-padded buffers and run by
    # ``graph_executor``, a name of the executor registry (refengine/graph/executors.py, which
    # says what each one is and on which device it runs): "cuda" (CUDA graphs, the default on
    # a CUDA device), "aot" (AOTInductor packages compiled once per machine, the default on a
    # CPU), "compiled", "frozen" or "replay". None: the device's default.
    cuda_graph: bool = False
    graph_executor: str | None = None
    seed: int = 0
    retract_every: int = 0  # test hook: retract the middle decoding request every N decode steps
    # Overlap scheduling (SpecConfig(overlap=True)): run each decode step's forwards on a worker
    # thread while the previous step is resolved. False: the same one-step-late order in one
    # thread (deterministic mode). Both give the same tokens. None: the device's default, the
    # thread where launches are asynchronous (CUDA: the host resolves while the GPU computes),
    # one thread on the CPU, where the launch thread only competes with torch's own threads
    # for the same cores (docs/measurements.md).
    overlap_thread: bool | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.model, str) and bool(self.model), "model",
                 f"must be a fixture name or a directory, got {self.model!r}")
        require(is_int(self.page_size) and self.page_size >= 1, "page_size",
                 f"must be an integer >= 1, got {self.page_size!r}")
        require(is_int(self.kv_pool_tokens) and self.kv_pool_tokens >= self.page_size,
                 "kv_pool_tokens", f"must be an integer >= page_size ({self.page_size}), "
                 f"got {self.kv_pool_tokens!r}")
        require(is_int(self.max_running_requests) and self.max_running_requests >= 1,
                 "max_running_requests", f"must be an integer >= 1, got "
                 f"{self.max_running_requests!r}")
        require(is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1,
                 "max_prefill_tokens", f"must be an integer >= 1, got {self.max_prefill_tokens!r}")
        require(isinstance(self.device, str)
                 and (self.device == "cpu" or self.device.startswith("cuda")), "device",
                 f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        require(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
                 f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        require(isinstance(self.strict_mem_check, bool), "strict_mem_check",
                 f"must be a bool, got {self.strict_mem_check!r}")
        require(is_int(self.seed) and self.seed >= 0, "seed",
                 f"must be an integer >= 0, got {self.seed!r}")
        require(is_int(self.retract_every) and self.retract_every >= 0, "retract_every",
                 f"must be an integer >= 0 (0 = off), got {self.retract_every!r}")
        if self.overlap_thread is None:  # frozen dataclass: resolve the default once, here
            object.__setattr__(self, "overlap_thread", self.device.startswith("cuda"))
        require(isinstance(self.overlap_thread, bool), "overlap_thread",
                 f"must be a bool, got {self.overlap_thread!r}")
        require(isinstance(self.cuda_graph, bool), "cuda_graph",
                 f"must be a bool, got {self.cuda_graph!r}")
        if self.graph_executor is None:  # frozen dataclass: resolve the default once, here
            object.__setattr__(self, "graph_executor", default_executor(self.device))
        require(self.graph_executor in GRAPH_EXECUTORS, "graph_executor",
                 f"must be one of {', '.join(GRAPH_EXECUTORS)}, got {self.graph_executor!r}")
        problem = EXECUTORS[self.graph_executor].device_problem(self.device)
        require(problem is None, "graph_executor", str(problem))
