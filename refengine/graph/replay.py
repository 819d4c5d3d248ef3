"""The "replay" executor: the program's forward run eagerly on the padded static views, the
same code as an eager step on fixed-size inputs, which is what the property tests need to check
staging, padding and slicing on the CPU."""

from __future__ import annotations

from typing import Generic

from refengine.graph.program import K2, R2, V2, Executor, K, Program, R, V


class ReplayExecutor(Generic[K, V, R]):
    """Runs the program (the model's own forward over the static views) eagerly."""

    name = "replay"
    outputs_persist = False  # every call allocates its outputs

    def __init__(self, program: Program[K, V, R]) -> None:
        self.program = program

    def prepare(self, key: K, views: V) -> None:
        self.program.run(key, views)  # nothing to capture; runs the padding-only batch once

    def run(self, key: K, views: V) -> R:
        return self.program.run(key, views)

    def pending(self) -> list[K]:
        return []  # nothing is ever left to prepare

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        return ReplayExecutor(program)

