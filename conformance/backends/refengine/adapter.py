"""The reference engine as a backend: the first certified implementation."""

from __future__ import annotations

import refengine
from conformance.backends.refengine.graph_probe import RefGraphProbe
from conformance.backends.refengine.kernels import default_kernels_for_refengine
from conformance.backends.refengine.worker_hooks import RefEngineWorkerHooks
from conformance.contract import Capabilities, Event, KernelImpls, MemoryView, OpenConfig, Request
from refengine import Engine, EngineConfig

# OpenConfig's limits, passed to EngineConfig only when set (None: the engine's default).
ENGINE_LIMITS = ("kv_pool_tokens", "page_size", "max_running_requests", "max_prefill_tokens")


class RefEngineHandle:
    def __init__(self, engine: Engine) -> None:
        self._engine: Engine | None = engine
        self._hooks: RefEngineWorkerHooks | None = None
        self._probe: RefGraphProbe | None = None

    @property
    def engine(self) -> Engine:
        """The engine this handle drives, until ``close``."""
        if self._engine is None:
            raise RuntimeError("the handle is closed")
        return self._engine

    def worker_hooks(self) -> RefEngineWorkerHooks:
        """Phase traces and forced verify outcomes (capability ``worker_hooks``)."""
        if self._hooks is None:
            self._hooks = RefEngineWorkerHooks(self.engine)
        return self._hooks

    def graph_probe(self) -> RefGraphProbe:
        """Synthetic decode and verify cases, eager and through the engine's graph runner
        (capability ``graph_runner``; the graph tier). Asked of a fresh, idle handle: the
        probe prefills requests of its own on the engine's KV manager."""
        if self._probe is None:
            self._probe = RefGraphProbe.for_engine(self.engine)
        return self._probe

    def submit(self, req: Request) -> None:
        self.engine.add_request(req.rid, list(req.prompt_ids), req.params, req.session_id)

    def step(self) -> list[Event]:
        return self.engine.step()

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def memory(self) -> MemoryView:
        return self.engine.memory()

    def open_session(self, session_id: str) -> None:
        self.engine.open_session(session_id)

    def close_session(self, session_id: str) -> None:
        self.engine.close_session(session_id)

    def in_flight(self) -> frozenset[str]:
        """Requests with a launched, unresolved step (capability ``in_flight``)."""
        return self.engine.in_flight()

    def close(self) -> None:
        self._engine = None  # drop the model and KV pool
        self._probe = None


class RefEngineBackend:
    name = "refengine"
    version = refengine.__version__
    engine_class: type[Engine] = Engine  # the bug zoo swaps in mutant subclasses

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none", "eagle", "eagle3", "frozen_kv_mtp",
                                                  "draft_model", "ngram"}), tree=True,
                            sampling=True, seeded_sampling=True,
                            stepwise=True, abort=True, memory_view=True, acceptance_stats=True,
                            reference_draft=True, worker_hooks=True, forced_retract=True,
                            chunked_prefill=True,
                            kernels=True, overlap=True, sessions=True, in_flight=True,
                            graph_runner=True)

    def kernel_impls(self) -> KernelImpls:
        """Tree kernels for the kernel tier: Triton, marked unavailable where it cannot run
        (without a GPU or TRITON_INTERPRET=1, where the engine uses the torch references)."""
        return default_kernels_for_refengine()

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        limits = {name: value for name in ENGINE_LIMITS
                  if (value := getattr(cfg, name)) is not None}
        return RefEngineHandle(self.engine_class(EngineConfig(
            model=cfg.model, spec=cfg.spec, **limits, seed=cfg.seed, strict_mem_check=True,
            retract_every=cfg.retract_every, device=cfg.device,
            cuda_graph=cfg.graph_executor is not None,
            # unset: the engine's default executor for its device
            **({"graph_executor": cfg.graph_executor} if cfg.graph_executor else {}))))


def backend() -> RefEngineBackend:
    return RefEngineBackend()
