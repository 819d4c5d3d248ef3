"""Resolve a backend named on the command line: ``module:factory``, an entry-point name (group
``specgate.backends``) or ``mutant:<name>`` (the bug zoo: class mutants and source-patch
mutants). Problems raise ``BackendError`` with one line naming them."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points

from conformance.contract import Backend, unclaimed_reasons
from conformance.contract.versions import as_current

ENTRY_POINT_GROUP = "specgate.backends"
BUILTIN = {  # so a checkout works before `pip install -e .` registers the entry points
    "refengine": "conformance.backends.refengine:backend",
    "hf": "conformance.backends.hf:backend",
    "ctranslate2": "conformance.backends.ctranslate2.backend:backend",
    "vllm": "conformance.backends.vllm:backend",
}
# bundled backends whose libraries are an optional extra of specgate
EXTRAS = {"hf": "hf", "ctranslate2": "ctranslate2", "vllm": "vllm"}


# module:factory as the command line may give it: dotted identifiers, no relative import
MODULE_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


def _line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


class BackendError(ValueError):
    """The backend could not be found, imported or constructed."""


def known_backends() -> list[str]:
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names | BUILTIN.keys())


def _target(spec: str) -> str:
    if ":" in spec:
        return spec
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            return ep.value
    if spec in BUILTIN:
        return BUILTIN[spec]
    raise BackendError(f"unknown backend {spec!r} (known: {', '.join(known_backends())}; "
                       "or give module:factory)")


MUTANTS_MODULE = "conformance.backends.mutants"  # the bug zoo, resolved by name like BUILTIN


def _load_mutant(name: str, launcher: bool) -> Backend:
    try:
        mutant: Backend = importlib.import_module(MUTANTS_MODULE).load_mutant(name, launcher)
    except ValueError as err:
        raise BackendError(str(err)) from None
    return mutant


def load_backend(spec: str, launcher: bool = False) -> Backend:
    """``launcher``: the caller only checks the backend and runs the suite through
    ``conformance.run.suite`` (which starts the process a source mutant needs)."""
    if spec.startswith("mutant:"):
        return _load_mutant(spec.split(":", 1)[1], launcher)
    target = _target(spec)
    if not MODULE_FACTORY.fullmatch(target):
        raise BackendError(f"backend {spec!r:.120}: expected module:factory with an absolute, "
                           "dotted module name (package.module:name)")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a module that raises on import is as unusable as a missing one
        hint = (f"; install it with: pip install 'specgate[{EXTRAS[spec]}]'" if spec in EXTRAS
                else "")
        raise BackendError(f"backend {spec!r}: cannot import {module_name!r} "
                           f"({type(err).__name__}: {_line(err)}){hint}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise BackendError(f"backend {spec!r}: module {module_name!r} has no {attr!r}")
    try:
        backend = (factory() if callable(factory) and not isinstance(factory, Backend)
                   else factory)
    except ImportError as err:  # a factory that imports its library late (vllm): name it
        line = _line(err)
        if spec in EXTRAS and "pip install" not in line:
            line += f"; install it with: pip install 'specgate[{EXTRAS[spec]}]'"
        raise BackendError(f"backend {spec!r}: {line}") from None
    except Exception as err:
        raise BackendError(f"backend {spec!r}: {target}() raised {type(err).__name__}: "
                           f"{_line(err)}") from None
    if not isinstance(backend, Backend):
        raise BackendError(f"backend {spec!r}: {target} did not give a Backend (needs name, "
                           "version, capabilities(), open())")
    try:
        unclaimed_reasons(backend)
        # the one place a backend written for an older contract gets that contract's meaning
        return as_current(backend)
    except ValueError as err:
        raise BackendError(f"backend {spec!r}: {err}") from None
