"""What an executor runs, and the executor itself: the two sides of one protocol.

A ``Program`` is a static forward keyed by shape: for a key (the target's ``GraphKey``, a
draft loop's (bucket, key width)) and that key's staged views it gives an output. It offers
the forward in the two forms the executors need: eagerly on the views (``run``: what the
replay executor calls and a CUDA graph records) and as a module over flat tensors
(``module``/``inputs``/``outputs``: what the compiled executors compile and the "aot" executor
exports, each key its own module with the key's constants baked in).

An ``Executor`` runs one program per key (``prepare`` ahead of serving, ``run`` per step).
``sibling`` gives an executor of the same kind for another program, sharing what the kind
shares between forwards (the CUDA-graph recorder and its memory pool, the package cache, the
compile settings): that is how the draft loops run on the target's executor.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from refengine.graph.export import Dims

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
R = TypeVar("R")
K2 = TypeVar("K2", bound=Hashable)
V2 = TypeVar("V2")
R2 = TypeVar("R2")


@dataclass(frozen=True)
class PackageSpec:
    """How a key's persistent package is named and built: ``label`` names it for people and
    carries the constants baked into its code; ``rows``: the rows its forwards multiply per
    GEMM (which GEMM kernels it gets); ``free``: per input, the dimensions left free."""

    label: str
    rows: int
    free: list[Dims | None]


class Program(Protocol[K, V, R]):
    def run(self, key: K, views: V) -> R:
        """The forward of ``key`` on its staged ``views``, eagerly."""

    def module(self, key: K) -> torch.nn.Module:
        """``key``'s forward as a module whose ``forward(*inputs)`` returns flat tensors."""

    def weights(self) -> torch.nn.Module:
        """A module holding every tensor the key modules fold in, of the same classes (what a
        package's digests cover)."""

    def inputs(self, views: V) -> list[torch.Tensor]:
        """The key module's inputs on ``views``."""

    def outputs(self, tensors: Sequence[torch.Tensor]) -> R:
        """The key module's flat outputs as ``run`` gives them."""

    def package(self, key: K, views: V) -> PackageSpec:
        """How ``key``'s package is named and built."""


class Executor(Protocol[K, V, R]):
    name: str
    # True when the returned tensors live in executor-owned memory that the next run
    # overwrites (a CUDA graph's output pool): the caller must copy them out.
    outputs_persist: bool

    def prepare(self, key: K, views: V) -> None:
        """Capture, compile or load ``key`` (``views`` hold a batch of padding only)."""

    def run(self, key: K, views: V) -> R:
        """The program's forward of the staged key."""

    def pending(self) -> list[K]:
        """Keys first needed where they could not be prepared (a CUDA graph off the
        recorder's thread), to prepare now on padding; empty where this thread cannot."""

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        """An executor of this kind for ``program``, sharing this one's resources."""


def copy_out(out: R) -> R:
    """A copy of a run's outputs (a tensor, a tuple of them or a dataclass of them) that the
    executor's next run cannot overwrite (``Executor.outputs_persist``)."""
    if isinstance(out, torch.Tensor):
        return out.clone()  # type: ignore[return-value]
    if isinstance(out, tuple):
        items = [copy_out(o) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)  # type: ignore[return-value]
    return type(out)(**{name: copy_out(v) for name, v in vars(out).items()})
