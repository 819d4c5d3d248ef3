"""Contract versions: which contract a backend was written for, and how the suite keeps that
contract's semantics for it (docs/adapter.md, "Contract versions"; CHANGELOG.md, "Adapter
contract").

A backend may declare ``contract_version = N``; without the attribute it is taken to be
written for the current contract, ``CONTRACT_VERSION``. A backend written for an older
contract is wrapped once, where backends are loaded (``conformance.plan.registry``), in a
``VersionedBackend`` that translates every ``OpenConfig`` it is opened with into what that
contract promised, or refuses in one line what that contract cannot express. Everything else
(capabilities, handles, optional extras such as ``unclaimed_reasons`` or ``kernel_impls``) is
the wrapped backend's own, untouched, since no other part of the contract changed meaning.

Versions:

1. The contract up to the re-layout (commit 9c29afd): ``OpenConfig``'s limits are always
   integers (``kv_pool_tokens`` 16384, ``page_size`` 1, ``max_running_requests`` 64,
   ``max_prefill_tokens`` 2048 unless a check sets them) and it has no ``device`` field.
2. The current contract: a limit left ``None`` is the backend's own default, and
   ``OpenConfig.device`` says where to run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from conformance.contract.adapter import Backend, Capabilities, EngineHandle, OpenConfig

CONTRACT_VERSION = 2
KNOWN_VERSIONS = (1, 2)

# What contract 1's OpenConfig held where the suite now leaves a limit None.
V1_LIMITS = {"kv_pool_tokens": 16384, "page_size": 1, "max_running_requests": 64,
             "max_prefill_tokens": 2048}


class ContractRefusal(ValueError):
    """A run asks for something the backend's contract version has no way to say (one line)."""


def declared_version(backend: object) -> int:
    """The contract version ``backend`` declares in ``contract_version`` (the current one when
    it has no such attribute); ValueError, one line, for a value that names no version."""
    if not hasattr(backend, "contract_version"):
        return CONTRACT_VERSION
    declared = backend.contract_version
    # bool is an int subclass: True is a mistake, not version 1
    if type(declared) is not int or declared not in KNOWN_VERSIONS:
        raise ValueError(f"contract_version {declared!r:.40} is not a contract version "
                         f"(known: {', '.join(map(str, KNOWN_VERSIONS))}; leave it out for "
                         f"the current one, {CONTRACT_VERSION})")
    return declared


def config_for(cfg: OpenConfig, version: int, name: str) -> OpenConfig:
    """``cfg`` as contract ``version`` defines it, for the backend called ``name``: for 1, its
    defaults in every limit left None; ContractRefusal when ``cfg`` asks for what that contract
    cannot express (a device other than the CPU)."""
    if version == CONTRACT_VERSION:
        return cfg
    if version != 1:
        raise ValueError(f"contract_version {version!r}: no translation to it")
    if cfg.device != "cpu":
        raise ContractRefusal(
            f"backend {name!r} was written for contract 1, which has no OpenConfig.device: "
            f"it cannot be asked to run on {cfg.device!r}; certify it with --device cpu, or "
            "move it to contract 2 (docs/adapter.md)")
    return replace(cfg, **{limit: value for limit, value in V1_LIMITS.items()
                           if getattr(cfg, limit) is None})


class VersionedBackend:
    """A backend written for an older contract, as the suite drives it: ``open`` translates
    the config (``config_for``); every other attribute, the optional extras included, is the
    wrapped backend's own (absent there, absent here), so the suite sees what it declares."""

    def __init__(self, wrapped: Backend, version: int) -> None:
        self.wrapped = wrapped
        self.contract_version = version

    @property
    def name(self) -> str:
        return self.wrapped.name

    @property
    def version(self) -> str:
        return self.wrapped.version

    def capabilities(self) -> Capabilities:
        return self.wrapped.capabilities()

    def open(self, cfg: OpenConfig) -> EngineHandle:
        return self.wrapped.open(config_for(cfg, self.contract_version, self.wrapped.name))

    def __getattr__(self, attr: str) -> Any:
        # Reached only for what this class lacks: the wrapped backend's extras, looked up
        # with getattr/hasattr by the tiers; a missing one raises AttributeError as there.
        if attr.startswith("__") or attr == "wrapped":
            raise AttributeError(attr)
        return getattr(self.wrapped, attr)


def as_current(backend: Backend) -> Backend:
    """``backend`` as the current contract drives it: itself when it declares the current
    version (or none), else wrapped in a ``VersionedBackend``; ValueError, one line, for a
    declared version specgate does not know."""
    if isinstance(backend, VersionedBackend):
        return backend
    version = declared_version(backend)
    return backend if version == CONTRACT_VERSION else VersionedBackend(backend, version)
