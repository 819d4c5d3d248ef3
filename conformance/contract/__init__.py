"""The contract: everything a backend needs to be certified, and nothing else.

It imports neither torch nor the reference engine (a test checks it with both blocked): an
adapter for another engine depends on this package alone. The wire types (requests, events,
memory view) come from ``specwire``, which the reference engine speaks natively.
``CONTRACT_VERSION`` numbers this contract; a backend written for an older one declares it
(``contract_version``) and keeps that contract's semantics (``contract/versions.py``).
"""

from conformance.contract.adapter import (
    ALGORITHMS,
    FLAG_NAMES,
    PRECISIONS,
    Backend,
    Capabilities,
    EngineHandle,
    OpenConfig,
    Request,
    effective_page_size,
    is_device_name,
    unclaimed_reasons,
    unclaimed_under,
)
from conformance.contract.graph_probe import (
    PADDED_FIELDS,
    STATE_DIGESTS,
    GraphCase,
    GraphProbe,
    GraphRun,
    KeyWidthProbe,
    Mode,
    PaddingPolicy,
)
from conformance.contract.kernels import BuildTree, KernelImpls, VerifyGreedy
from conformance.contract.versions import CONTRACT_VERSION
from conformance.contract.worker_hooks import PhaseRecord, WorkerHooks
from specwire import (
    Event,
    FinishEvent,
    FinishReason,
    MemoryView,
    ReqKV,
    RetractEvent,
    SamplingParams,
    SpecConfig,
    TokenEvent,
)

__all__ = [
    "ALGORITHMS", "CONTRACT_VERSION", "FLAG_NAMES", "PADDED_FIELDS", "PRECISIONS",
    "STATE_DIGESTS", "Backend", "BuildTree", "Capabilities", "EngineHandle", "Event",
    "FinishEvent", "FinishReason", "GraphCase", "GraphProbe", "GraphRun", "KernelImpls",
    "KeyWidthProbe", "MemoryView", "Mode", "OpenConfig", "PaddingPolicy", "PhaseRecord", "ReqKV",
    "Request", "RetractEvent", "SamplingParams", "SpecConfig", "TokenEvent", "VerifyGreedy",
    "WorkerHooks", "effective_page_size", "is_device_name", "unclaimed_reasons",
    "unclaimed_under",
]
