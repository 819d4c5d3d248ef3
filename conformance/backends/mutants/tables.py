"""Component tables for mutants: the reference engine's worker and draft-model tables with one
entry replaced, so a mutant names only what it breaks."""

from __future__ import annotations

from refengine import Engine
from refengine.model.eagle import EagleDraftModel
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.speculative.eagle_v1 import EagleV1Worker

WorkerTable = dict[tuple[str, bool], type[EagleV1Worker]]


def with_worker(algorithm: str, worker: type[EagleV1Worker],
                table: WorkerTable | None = None) -> WorkerTable:
    """A worker table (the reference engine's by default) with ``algorithm``'s sequential
    (V1) worker replaced."""
    return {**(Engine.worker_classes if table is None else table), (algorithm, False): worker}


def with_draft(algorithm: str, draft: type[FrozenKVMTPDraftModel]
               ) -> dict[str, type[EagleDraftModel] | type[FrozenKVMTPDraftModel]]:
    """The reference engine's draft-model table with ``algorithm``'s loader replaced."""
    return {**Engine.draft_classes, algorithm: draft}
