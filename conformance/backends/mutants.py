"""The bug zoo: the reference engine with one real bug class planted, as a backend.

Each mutant is a subclass of the engine or of one of its components (scheduler, KV manager),
overriding a single method; nothing here is a flag in the production path. ``specgate
mutants`` runs the suite against every mutant, and every one must be killed by some check: a
suite that cannot kill its mutants has no teeth. Wherever a backend is named, a mutant is
``mutant:<name>``.

These model plain-decoding bug classes from production engines' catalogues
(``../shared/reference``): leaked KV, leaked request rows, stale state after retraction,
off-by-one length checks, dropped stop conditions, batch-dependent attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conformance.backends.refengine import RefEngineBackend
from refengine import Engine
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata
from refengine.request import FinishReason, Req
from refengine.scheduler import Scheduler
from refengine.stopping import finish_reason


class _LeakLastPage(KVManager):
    def release(self, req: Req) -> None:
        if req.row is not None and req.finish_reason in ("stop", "length"):
            # The page loop stops one page short; the row is returned, the page never is.
            self.truncate(req, self.page_size)
            self.rows.free_row(req.row)
            req.row = None
            return
        super().release(req)


class LeakOnFinish(Engine):
    """KV slots leak by one page per finished request."""

    kv_manager_class = _LeakLastPage


class _AbortKeepsRow(Scheduler):
    def remove(self, req: Req) -> None:
        if req.finish_reason == "abort" and req.row is not None:
            for queue in (self.waiting, self.running):
                if req in queue:
                    queue.remove(req)
            self.kv.truncate(req, 0)
            req.row = None  # the row is dropped without going back to the pool
            return
        super().remove(req)


class AbortLeaksRow(Engine):
    """Abort returns the KV slots but not the request row."""

    scheduler_class = _AbortKeepsRow


class _RetractKeepsCommitted(Scheduler):
    def _retract(self, victim: Req) -> Req:
        committed = victim.kv_committed_len
        super()._retract(victim)
        victim.kv_committed_len = committed  # stale: the re-prefill skips what it "has"
        return victim


class RetractStaleCommitted(Engine):
    """Retraction frees the KV but leaves the committed length behind."""

    scheduler_class = _RetractKeepsCommitted


class MaxNewTokensOffByOne(Engine):
    """The length limit is compared with ``>`` instead of ``>=``: one token too many."""

    def _finish_reason(self, req: Req) -> FinishReason | None:
        reason = super()._finish_reason(req)
        if reason == "length" and len(req.output_ids) == req.params.max_new_tokens:
            return None
        return reason


class IgnoresStopTokenIds(Engine):
    """``stop_token_ids`` is dropped on the way to the finish check (EOS still works)."""

    def _finish_reason(self, req: Req) -> FinishReason | None:
        return finish_reason(replace(req.params, stop_token_ids=()), req.output_ids,
                             req.seq_len, self.eos_token_id, self.max_context_len,
                             self.tokenizer.decode)


class BatchLeaksAcrossRows(Engine):
    """Keys are masked by the batch's longest length instead of each request's own, so a
    short request attends to stale slots of its row: output depends on its batch-mates."""

    def _attention_metadata(self, rows: torch.Tensor, extend_lens: list[int],
                            seq_lens: list[int]) -> AttentionMetadata:
        meta = super()._attention_metadata(rows, extend_lens, seq_lens)
        longest = max(seq_lens)
        for b, n in enumerate(extend_lens):
            meta.mask[b, 0, :n, :longest - n] = True  # every cached position "visible"
        return meta


@dataclass(frozen=True)
class Mutant:
    name: str
    engine_class: type[Engine]

    @property
    def bug_class(self) -> str:
        doc = (self.engine_class.__doc__ or "").strip()
        return " ".join(doc.split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("leak_on_finish", LeakOnFinish),
    Mutant("abort_leaks_row", AbortLeaksRow),
    Mutant("retract_stale_committed", RetractStaleCommitted),
    Mutant("max_new_tokens_off_by_one", MaxNewTokensOffByOne),
    Mutant("ignores_stop_token_ids", IgnoresStopTokenIds),
    Mutant("batch_leaks_across_rows", BatchLeaksAcrossRows),
]}


class MutantBackend(RefEngineBackend):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"
        self.engine_class = mutant.engine_class


def mutant_backend(name: str) -> MutantBackend:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})")
    return MutantBackend(MUTANTS[name])
