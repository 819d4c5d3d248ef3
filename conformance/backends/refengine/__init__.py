"""The reference engine as a backend: its adapter, graph probe, worker hooks and kernels."""

from conformance.backends.refengine.adapter import RefEngineBackend, RefEngineHandle, backend

__all__ = ["RefEngineBackend", "RefEngineHandle", "backend"]
