"""What a program's key module needs to be exported into a persistent package: the input
dimensions that follow an engine's limits rather than the key (left free, so engines opened
with other limits share the package), and the tables it borrows registered as its buffers (so
a package's weights digest covers them)."""

from __future__ import annotations

import torch

from refengine.model.llama import Rotary

Dims = dict[int, torch.export.Dim]  # an input's dimensions that a package leaves free


def open_limits() -> tuple[Dims, Dims]:
    """The free dimensions of the KV pool (its slots) and of the row table (its rows): they
    follow the limits an engine opens with (pool tokens, requests), not the shapes a key
    computes on, so engines opened with other limits share the package. The table's width
    stays fixed: a key at the widest width reads the whole row, a narrower one a prefix, and
    export compiles the two differently."""
    return {1: torch.export.Dim("slots", min=2)}, {0: torch.export.Dim("rows", min=2)}


def register_tables(module: torch.nn.Module, rotary: Rotary) -> None:
    """The rotary tables (plain tensors, not module state) as ``module``'s buffers, so the
    weights digest of what a package exports covers them (they follow the model's config)."""
    module.register_buffer("rotary_cos", rotary.cos, persistent=False)
    module.register_buffer("rotary_sin", rotary.sin, persistent=False)
