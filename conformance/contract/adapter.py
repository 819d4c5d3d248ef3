"""The adapter protocols: what a backend implements so the suite can drive it (docs/adapter.md).

A third-party backend implements ``Backend`` and ``EngineHandle`` and declares honest
``Capabilities``; every check gated on a capability it does not declare is reported as
"not claimed", never as passed. Requests, events and the memory view are the wire types of
``specwire`` (shared with the reference engine, which imports nothing of conformance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from specwire import Event, MemoryView, SamplingParams, SpecConfig

ALGORITHMS = frozenset({"none", "eagle", "eagle3", "frozen_kv_mtp", "draft_model", "ngram"})
# The arithmetic a backend computes logits in; it sets how close to a tie a greedy choice may be
# and still legitimately differ from the float32 reference (checks/oracle.py NEAR_TIE_EPSILON;
# bfloat16 and float16 calibrated per run, checks/calibration.py).
PRECISIONS = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class Capabilities:
    algorithms: frozenset[str] = frozenset({"none"})
    precision: str = "float32"       # one of PRECISIONS; not a flag
    tree: bool = False
    overlap: bool = False
    sampling: bool = False
    seeded_sampling: bool = False    # SamplingParams.seed alone fixes a sampled request's tokens
    stepwise: bool = False
    abort: bool = False
    sessions: bool = False
    memory_view: bool = False
    acceptance_stats: bool = False
    reference_draft: bool = False
    worker_hooks: bool = False
    graph_runner: bool = False
    # Extensions beyond the core adapter (docs/decisions.md):
    forced_retract: bool = False     # honours OpenConfig.retract_every (a test hook)
    chunked_prefill: bool = False    # honours OpenConfig.max_prefill_tokens: a longer prompt is
                                     # prefilled over several steps, streaming nothing before
                                     # its last chunk
    kernels: bool = False            # exposes kernel_impls() for the kernel tier
    in_flight: bool = False          # handle.in_flight(): requests with a launched, unresolved
                                     # step (overlap scheduling), so the suite can act on them
    page_multiple: int = 1           # pool pages must be a multiple of this many tokens: the
                                     # suite asks page sizes rounded up to it (not a flag;
                                     # effective_page_size)

    def __post_init__(self) -> None:
        unknown = set(self.algorithms) - ALGORITHMS
        if unknown:
            raise ValueError(f"algorithms: unknown {sorted(unknown)} (known: {sorted(ALGORITHMS)})")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: unknown {self.precision!r} (known: {sorted(PRECISIONS)})")
        # bool is an int subclass: True is a mistake, not 1
        if type(self.page_multiple) is not int or self.page_multiple < 1:
            raise ValueError(f"page_multiple: expected a positive integer, got "
                             f"{self.page_multiple!r:.40}")

    def claims(self, name: str) -> bool:
        """``name`` is a flag ("abort") or an algorithm ("algorithm:eagle")."""
        if name.startswith("algorithm:"):
            return name.split(":", 1)[1] in self.algorithms
        if name not in FLAG_NAMES:
            raise ValueError(f"unknown capability {name!r} (known: {sorted(FLAG_NAMES)})")
        return bool(getattr(self, name))

    def as_dict(self) -> dict[str, list[str] | str | int | bool]:
        """The capabilities as JSON takes them: the algorithms sorted, the precision, the page
        multiple, then every flag by name."""
        return {"algorithms": sorted(self.algorithms), "precision": self.precision,
                "page_multiple": self.page_multiple,
                **{n: bool(getattr(self, n)) for n in sorted(FLAG_NAMES)}}


FLAG_NAMES = frozenset(f for f in Capabilities.__dataclass_fields__
                       if f not in ("algorithms", "precision", "page_multiple"))


def effective_page_size(caps: Capabilities, page_size: int) -> int:
    """The page size the suite asks of a backend where a check is written for ``page_size``:
    rounded up to the next multiple of ``caps.page_multiple`` (docs/adapter.md, "Page
    sizes"), so a pool of fixed granularity is never asked what it cannot honour."""
    multiple = caps.page_multiple
    return -(-page_size // multiple) * multiple


@dataclass(frozen=True)
class OpenConfig:
    """What the suite asks a backend to load: the fixture model (and draft), limits, seed.

    Limits are requests, not orders: a backend without a paged pool may ignore
    ``kv_pool_tokens``/``page_size``, but must then not claim ``memory_view``. A limit left
    ``None`` is the backend's own default; a check that depends on one sets it.
    """

    model: str = "tiny-code"
    spec: SpecConfig | None = None
    kv_pool_tokens: int | None = None
    page_size: int | None = None
    max_running_requests: int | None = None  # also the batch a run-to-completion backend runs
    max_prefill_tokens: int | None = None
    seed: int = 0
    retract_every: int = 0  # test hook: retract the middle decoding request every N steps
    # Run the target's forwards through the backend's graph runner with this executor (for
    # refengine "replay" or "compiled"); None: eager. Asked only of backends claiming
    # ``graph_runner`` (certify --graphs).
    graph_executor: str | None = None
    # Where the backend runs: "cpu", "cuda" or "cuda:N" (certify --device). A backend that
    # cannot run on the device raises ValueError from ``open`` with a one-line reason.
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not is_device_name(self.device):
            raise ValueError(f"device: expected cpu, cuda or cuda:N, got {self.device!r}")


def is_device_name(name: object) -> bool:
    """``cpu``, ``cuda`` or ``cuda:N`` (N a non-negative integer)."""
    if name in ("cpu", "cuda"):
        return True
    return (isinstance(name, str) and name.startswith("cuda:")
            and name[5:].isdigit() and name[5:].isascii())


@dataclass(frozen=True)
class Request:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None


@runtime_checkable
class EngineHandle(Protocol):
    """One running engine instance.

    Capability extras (not part of this protocol, asked only of backends claiming them):
    ``worker_hooks()`` (``worker_hooks``), ``in_flight()`` (``in_flight``), ``graph_probe()
    -> GraphProbe`` (``graph_runner``: the graph tier, ``contract/graph_probe.py``).
    """

    def submit(self, req: Request) -> None: ...
    def step(self) -> list[Event]: ...
    def abort(self, rid: str) -> None: ...
    def memory(self) -> MemoryView: ...
    def open_session(self, session_id: str) -> None: ...
    def close_session(self, session_id: str) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What ``--backend`` names.

    Optional extra: ``unclaimed_reasons() -> dict[str, str]``, one line per capability the
    backend does not claim saying why (keys as ``Capabilities.claims`` takes them: a flag, or
    ``algorithm:<name>``); the certificate shows them beside what was not claimed.

    Optional extra: ``unclaimed_under(spec: SpecConfig) -> dict[str, str]``, capability flags
    the backend claims but not under this speculative configuration, one line each saying why
    (e.g. a backend that drafts as the reference with one EAGLE head and not with another). A
    check needing one of them is "not claimed" for that configuration alone.

    Optional attribute: ``contract_version``, the contract the backend was written for
    (``contract/versions.py``); left out, the current ``CONTRACT_VERSION``.
    """

    name: str
    version: str

    def capabilities(self) -> Capabilities: ...
    def open(self, cfg: OpenConfig) -> EngineHandle: ...


def unclaimed_reasons(backend: Backend) -> dict[str, str]:
    """The backend's reasons for what it does not claim ({} if it gives none); ValueError for
    a key naming no capability or one it claims, or a reason that is not one line."""
    give = getattr(backend, "unclaimed_reasons", None)
    if give is None:
        return {}
    reasons = dict(give())
    caps = backend.capabilities()
    for name, why in reasons.items():
        known = (name.split(":", 1)[1] in ALGORITHMS if name.startswith("algorithm:")
                 else name in FLAG_NAMES)
        if not known:
            raise ValueError(f"unclaimed_reasons: {name!r} is not a capability")
        if caps.claims(name):
            raise ValueError(f"unclaimed_reasons: {name!r} is claimed")
        _one_line("unclaimed_reasons", name, why)
    return reasons


def unclaimed_under(backend: Backend, spec: SpecConfig) -> dict[str, str]:
    """The flags the backend claims but not under ``spec``, with its reasons ({} if it gives
    none); ValueError for a key that is not a flag it claims, or a reason that is not one
    line."""
    give = getattr(backend, "unclaimed_under", None)
    if give is None:
        return {}
    reasons = dict(give(spec))
    caps = backend.capabilities()
    for name, why in reasons.items():
        if name not in FLAG_NAMES or not caps.claims(name):
            raise ValueError(f"unclaimed_under: {name!r} is not a capability flag the backend "
                             "claims")
        _one_line("unclaimed_under", name, why)
    return reasons


def _one_line(where: str, name: str, why: object) -> None:
    if not isinstance(why, str) or not why.strip() or "\n" in why:
        raise ValueError(f"{where}: {name!r} needs a one-line reason")
