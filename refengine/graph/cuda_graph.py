"""The CUDA-graph executor: each key's forward captured once with ``torch.cuda.CUDAGraph`` and
replayed, for the target's decode and verify kinds and for the draft loops and EAGLE's
draft-extend (``DraftLoopGraph``).

A graph records the kernels of one call of a callable on fixed addresses: the staged views
(``Staging``, ``LoopStaging``: allocated once, a bucket's view a stable prefix), the model's
weights, the KV pools and the row table. A replay re-runs those kernels on whatever those
addresses hold then, so everything that changes between steps must be restaged before each
replay (``Staging.stage``/``LoopStaging.stage`` copy every buffer, every time: a buffer left as
captured replays an earlier step's values), and nothing may be computed on the host inside the
callable (``search``, ``static_attention`` and the model's forward do tensor work only).

Memory: every capture of one runner allocates from one private pool (``CudaGraphs.pool``), so
the keys share their temporaries instead of each holding its own. The price is that a replay
may overwrite memory another key's outputs live in, so the outputs of a replay are valid only
until the next replay of any key: ``outputs_persist`` makes the graph runner and the draft
loops copy them out at once.

Captures happen only on the thread that built the recorder (the engine's): a capture on the
overlap scheduler's launch thread, beside the resolving thread's own CUDA work, can be
invalidated by it (docs/decisions.md). A key first needed on another thread runs eagerly that
once and is queued (``pending``); the engine captures the queue
(``GraphRunner.capture_pending``, through each executor's ``pending``) on its own thread
before the next launch, on a batch of padding, while nothing else runs.

``EmulatedGraphs`` is a CPU stand-in with the same observable contract (static outputs,
overwritten in place by every replay; inputs read at replay), so the executor's capture,
staging and copy-out logic runs in CPU tests and CI; only the recording itself needs a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import torch

from refengine.graph.program import K2, R2, V2, Executor, K, Program, R, V

WARMUP_CALLS = 2  # before capture: lazy initialisation (cuBLAS handles, autotuning) stays out


@dataclass
class Captured:
    """One recorded callable: ``replay()`` re-runs it and returns its static ``outputs``."""

    replay_fn: Callable[[], None]
    outputs: Any  # the callable's return value: tensors, a tuple of them or a dataclass

    def replay(self) -> Any:
        self.replay_fn()
        return self.outputs


class GraphRecorder(Protocol):
    name: str
    captures: int

    def capture(self, fn: Callable[[], Any]) -> Captured:
        """Record ``fn`` (which reads only fixed addresses) for replay."""

    def may_capture(self) -> bool:
        """Whether this thread may capture now (the recorder's own thread only)."""


class OwnThread:
    """Capturing is allowed on the thread that made the recorder, and nowhere else."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()

    def may_capture(self) -> bool:
        return threading.get_ident() == self.owner


class CudaGraphs(OwnThread):
    """Real CUDA graphs on one device: warm-up on a side stream, then capture into the
    recorder's private memory pool, shared by all its graphs (see the module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"graph_executor: 'cuda' needs a CUDA device, got {self.device}")
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> Captured:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        torch.cuda.synchronize(self.device)
        self.captures += 1
        return Captured(graph.replay, outputs)


def _copy_into(static: Any, fresh: Any) -> None:
    """Write ``fresh`` (a call's result) into ``static`` (the first call's), same structure."""
    if static is None:  # an optional output the program does not produce
        return
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, tuple):
        for s, f in zip(static, fresh, strict=True):
            _copy_into(s, f)
    else:  # a dataclass of tensors (the draft search's ``Candidates``, ``ForwardOutput``)
        for name in vars(static):
            _copy_into(getattr(static, name), getattr(fresh, name))


class EmulatedGraphs(OwnThread):
    """A CPU stand-in for ``CudaGraphs``: capture calls ``fn`` once and keeps its result as the
    static outputs; a replay calls ``fn`` again and copies the result into those same tensors.
    What a CPU test can then see, as on a GPU: inputs are read at replay (a stale staged buffer
    replays stale values), and a replay's outputs are overwritten by the next one."""

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> Captured:
        assert self.may_capture(), "a capture off the recorder's thread"
        outputs = fn()
        self.captures += 1

        def replay() -> None:
            with torch.inference_mode():  # the outputs are inference tensors
                _copy_into(outputs, fn())

        return Captured(replay, outputs)


class KeyedGraphs:
    """One recorder's graphs by key, and the rule both the target's executor and the draft
    loops follow: a key is captured on its first use where the recorder may capture, else
    run eagerly that once and queued (``pending``) for ``capture`` on the engine's thread."""

    def __init__(self, recorder: GraphRecorder) -> None:
        self.recorder = recorder
        # keys: a ``GraphKey``, or a draft loop's (bucket, key width)
        self.captured: dict[Any, Captured] = {}
        self.pending: set[Any] = set()

    def capture(self, key: Any, fn: Callable[[], Any]) -> None:
        if key not in self.captured:
            with torch.inference_mode():
                self.captured[key] = self.recorder.capture(fn)
        self.pending.discard(key)

    def run(self, key: Any, fn: Callable[[], Any]) -> Any:
        """The key's replay (its static outputs), or ``fn()`` itself when it was queued."""
        if key not in self.captured:
            if not self.recorder.may_capture():
                self.pending.add(key)
                with torch.inference_mode():
                    return fn()  # eagerly, this once
            self.capture(key, fn)
        return self.captured[key].replay()


class CudaGraphExecutor(Generic[K, V, R]):
    """Each key of ``program`` as a CUDA graph: ``prepare`` captures a key on the staged views
    it is given (a batch of padding when capturing ahead, which writes only the dummy page;
    the step's own batch on first use, whose KV writes the replay then repeats with the same
    values), ``run`` replays it. Its siblings (the draft loops') record with the same recorder,
    into the same memory pool."""

    name = "cuda"
    outputs_persist = True  # the pool is shared: callers copy the outputs out

    def __init__(self, program: Program[K, V, R], graphs: GraphRecorder) -> None:
        self.program, self.graphs = program, graphs
        self.keyed = KeyedGraphs(graphs)

    def prepare(self, key: K, views: V) -> None:
        self.keyed.capture(key, lambda: self.program.run(key, views))

    def run(self, key: K, views: V) -> R:
        result: R = self.keyed.run(key, lambda: self.program.run(key, views))
        return result

    def pending(self) -> list[K]:
        return sorted(self.keyed.pending) if self.graphs.may_capture() else []

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        return CudaGraphExecutor(program, self.graphs)
