"""The capability extras a handle offers beside ``EngineHandle`` (its docstring lists them), as
protocols the suite narrows a handle to: a backend that claims the capability but whose handle
lacks the method fails the check in one line, instead of with an AttributeError mid-run."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from conformance.contract import EngineHandle, GraphProbe, WorkerHooks


@runtime_checkable
class InFlightHandle(Protocol):
    def in_flight(self) -> frozenset[str]:
        """Requests with a launched, unresolved step (capability ``in_flight``)."""


@runtime_checkable
class GraphProbeHandle(Protocol):
    def graph_probe(self) -> GraphProbe:
        """The graph runner's probe (capability ``graph_runner``)."""


@runtime_checkable
class WorkerHooksHandle(Protocol):
    def worker_hooks(self) -> WorkerHooks:
        """Phase traces and forced verify outcomes (capability ``worker_hooks``)."""


def in_flight_handle(handle: EngineHandle) -> InFlightHandle:
    assert isinstance(handle, InFlightHandle), (
        "the backend claims `in_flight` but its handle has no in_flight()")
    return handle


def graph_probe_handle(handle: EngineHandle) -> GraphProbeHandle:
    assert isinstance(handle, GraphProbeHandle), (
        "the backend claims `graph_runner` but its handle has no graph_probe()")
    return handle


def worker_hooks_handle(handle: EngineHandle) -> WorkerHooksHandle:
    assert isinstance(handle, WorkerHooksHandle), (
        "the backend claims `worker_hooks` but its handle has no worker_hooks()")
    return handle
