"""The graph executors by name: what each one is (where it runs, whether it compiles, whether
its compiled keys outlive the process, how much longer a suite case may take under it) and how
to make one for a static forward (``program.Program``).

This is the one list of executor names: ``EngineConfig`` validates ``graph_executor`` against
it and takes the device's default from it, the suite's options, device checks and case
timeouts read it, and the graph runner and its draft loops make their executors through it.
It imports no torch: the configuration and the CLI read it without loading torch, and an
executor's own module (which does) is imported only when one is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from refengine.graph.program import Executor, Program

Device = Literal["cpu", "cuda", "any"]
# What makes an executor: the static forward it runs and the device the engine runs on.
ExecutorFactory = Callable[["Program[Any, Any, Any]", str], "Executor[Any, Any, Any]"]


def device_kind(device: str) -> Literal["cpu", "cuda"]:
    """"cuda" for ``cuda`` and ``cuda:N``, else "cpu"."""
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class ExecutorInfo:
    """One executor: its properties, and ``make``, which imports its module and builds it."""

    name: str
    device: Device        # where it runs: "cpu", "cuda" or "any"
    compiles: bool        # generates code per key (first use of a key compiles it)
    persists: bool        # its compiled keys are kept on disk for later processes
    timeout_factor: int   # the suite's per-case timeout multiplier under it (compiles inside)
    label: str            # what it runs, as a plural noun ("CUDA graphs"), for messages
    description: str      # one line, for the docs' table
    make: ExecutorFactory = field(repr=False, compare=False)
    default_on: Literal["cpu", "cuda"] | None = None  # the device kind it is the default for
    # Why it runs on the CPU only, as a verb phrase (the message for a GPU engine).
    cpu_reason: str = ""

    def runs_on(self, device: str) -> bool:
        return self.device in ("any", device_kind(device))

    def device_problem(self, device: str) -> str | None:
        """Why this executor cannot run on ``device`` (one line); None when it can."""
        if self.runs_on(device):
            return None
        if self.device == "cuda":
            return f"{self.name!r} ({self.label}) needs device 'cuda[:N]', got {device!r}"
        return f"{self.name!r} {self.cpu_reason}; on a GPU use {_alternatives(device)}"


def _replay(program: Program[Any, Any, Any], device: str) -> Executor[Any, Any, Any]:
    from refengine.graph.replay import ReplayExecutor

    return ReplayExecutor(program)


def _compiled(program: Program[Any, Any, Any], device: str) -> Executor[Any, Any, Any]:
    from refengine.graph.compiled import CompiledExecutor

    return CompiledExecutor(program)


def _frozen(program: Program[Any, Any, Any], device: str) -> Executor[Any, Any, Any]:
    from refengine.graph.compiled import CompiledExecutor

    return CompiledExecutor(program, freeze_weights=True)


def _cuda(program: Program[Any, Any, Any], device: str) -> Executor[Any, Any, Any]:
    from refengine.graph.cuda_graph import CudaGraphExecutor, CudaGraphs

    return CudaGraphExecutor(program, CudaGraphs(device))


def _aot(program: Program[Any, Any, Any], device: str) -> Executor[Any, Any, Any]:
    from refengine.graph.aot import AotExecutor

    return AotExecutor(program)


_FOLDS = "folds the weights into CPU GEMM templates"

# In the order the CLI lists them.
EXECUTORS: dict[str, ExecutorInfo] = {info.name: info for info in (
    ExecutorInfo("compiled", "any", compiles=True, persists=False, timeout_factor=4,
                 label="compiled keys",
                 description="torch.compile per key (inductor): compiled once per machine "
                 "through inductor's cache, traced again by Dynamo in every process",
                 make=_compiled),
    ExecutorInfo("frozen", "cpu", compiles=True, persists=False, timeout_factor=4,
                 label="weight-folded compiled keys",
                 description="torch.compile per key with the weights folded in (inductor's "
                 "C++ GEMM templates); every process compiles each key again",
                 cpu_reason=_FOLDS, make=_frozen),
    ExecutorInfo("replay", "any", compiles=False, persists=False, timeout_factor=1,
                 label="eager replays",
                 description="the captured forward run eagerly on the static buffers: "
                 "staging and padding under test, no speed-up",
                 make=_replay),
    ExecutorInfo("cuda", "cuda", compiles=False, persists=False, timeout_factor=1,
                 label="CUDA graphs",
                 description="each key captured once as a CUDA graph and replayed",
                 default_on="cuda", make=_cuda),
    ExecutorInfo("aot", "cpu", compiles=True, persists=True, timeout_factor=4,
                 label="AOT packages",
                 description="AOTInductor packages with the weights folded in, compiled once "
                 "per machine, loaded by later processes and called without Dynamo",
                 default_on="cpu", cpu_reason=_FOLDS, make=_aot),
)}


def executor_names() -> tuple[str, ...]:
    return tuple(EXECUTORS)


def executor_info(name: str) -> ExecutorInfo:
    """The entry of ``name``; ValueError naming every executor for any other name."""
    if name not in EXECUTORS:
        raise ValueError(f"graph executor: one of {', '.join(EXECUTORS)}, got {name!r}")
    return EXECUTORS[name]


def default_executor(device: str) -> str:
    """The executor an engine on ``device`` uses unless told otherwise: the fastest one the
    graph tier passes on that kind of device."""
    kind = device_kind(device)
    return next(info.name for info in EXECUTORS.values() if info.default_on == kind)


def make_executor(name: str, program: Program[Any, Any, Any], device: str
                  ) -> Executor[Any, Any, Any]:
    """Executor ``name`` for ``program`` on ``device`` (its module imported now)."""
    return executor_info(name).make(program, device)


def _alternatives(device: str) -> str:
    """The executors that run on ``device``, its default first: "'a', 'b' or 'c'"."""
    default = default_executor(device)
    names = [default, *(n for n, info in EXECUTORS.items()
                        if info.runs_on(device) and n != default)]
    quoted = [repr(n) for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]]) if len(quoted) > 1 else quoted[0]
