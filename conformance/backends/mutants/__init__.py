"""The bug zoo: the reference engine with one real bug class planted, as a backend.

Each mutant is the engine with one component class replaced (scheduler, KV manager, model
runner, graph runner, output processor, speculative worker or its draft state) by a subclass
overriding a single method (or naming a broken part of its own: the graph runner's staging);
nothing here is a flag in the production path, and no mutant overrides a method of the engine
itself. ``specgate mutants`` runs the suite against every mutant, and every one must be
killed by some check: a suite that cannot kill its mutants has no teeth. Wherever a backend is
named, a mutant is ``mutant:<name>``.

These model bug classes from production engines (``docs/bug-classes.md``): leaked KV, leaked
request rows, stale state after retraction, off-by-one length checks, dropped stop conditions,
ignored sampling seeds, batch-dependent attention, stale graph padding (a mutant that opens
with the graph runner on, ``Mutant.graphs``), lossless draft-side regressions that only
acceptance shows (the golden tier's per-step check); and speculative-sampling bugs that only
show in the distribution of sampled tokens: ``biased_verify_sampler`` (the distribution tier's
negative control) and verify paths that misapply top-p or temperature. Mutants of shared code
written as source patches live in ``source_patches.py``. A mutant with ``spec`` other than
"none" behaves exactly like the reference engine under plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from conformance.backends.mutants.acceptance import DraftSkipsNonFinalChunks, SessionDropsDraftKV
from conformance.backends.mutants.graph import (
    BonusTokensNotRestaged,
    ExtendPaddingNotRestaged,
    StalePaddedRows,
)
from conformance.backends.mutants.lifecycle import (
    BatchLeaksAcrossRows,
    IgnoresStopTokenIds,
    MaxNewTokensOffByOne,
    SeedIgnored,
)
from conformance.backends.mutants.memory import (
    AbortLeaksRow,
    AbortStaysRunning,
    LeakOnFinish,
    RetractStaleCommitted,
)
from conformance.backends.mutants.overlap import (
    AbortLeaksReservation,
    LateCommit,
    StaleResultApplied,
)
from conformance.backends.mutants.sampling import (
    BiasedVerifySampler,
    VerifyIgnoresTopP,
    VerifyTemperatureMisapplied,
)
from conformance.backends.mutants.speculative import (
    AllFinishLeavesVerifyInput,
    DraftCatchUpSkipped,
    DraftExtendPhaseConfusion,
    DraftPositionShift,
    FrozenDraftWritesKV,
    MTPAllFinishLeavesVerifyInput,
    RejectedSlotsKeptPaged,
    RetractFilterPositional,
    SeedByBatchRow,
    StopInsideRunIgnored,
    StopStringAtRunEnd,
    TreeWrongParent,
)
from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import OpenConfig
from refengine import Engine


@dataclass(frozen=True)
class Mutant:
    name: str
    engine_class: type[Engine]
    spec: str = "none"  # the --spec under which the bug is visible (and which runs it)
    # The graph executor the mutant's engine always opens with (its bug lives in the graph
    # runner, which a run without --graphs would never reach); None: as the suite asks.
    graphs: Literal["replay", "compiled", "frozen"] | None = None
    # The suite check meant to kill it: a node id relative to the suite directory, run alone
    # against the mutant by the zoo tests (tests/test_zoo_killers.py).
    killed_by: str | None = None

    @property
    def bug_class(self) -> str:
        doc = (self.engine_class.__doc__ or "").strip()
        return " ".join(doc.split("\n\n")[0].split())


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("leak_on_finish", LeakOnFinish),
    Mutant("abort_leaks_row", AbortLeaksRow),
    Mutant("abort_stays_running", AbortStaysRunning),
    Mutant("retract_stale_committed", RetractStaleCommitted),
    Mutant("max_new_tokens_off_by_one", MaxNewTokensOffByOne),
    Mutant("ignores_stop_token_ids", IgnoresStopTokenIds),
    Mutant("batch_leaks_across_rows", BatchLeaksAcrossRows),
    Mutant("biased_verify_sampler", BiasedVerifySampler, spec="eagle"),
    Mutant("all_finish_leaves_verify_input", AllFinishLeavesVerifyInput, spec="eagle"),
    Mutant("draft_extend_phase_confusion", DraftExtendPhaseConfusion, spec="eagle"),
    Mutant("rejected_slots_kept_paged", RejectedSlotsKeptPaged, spec="eagle"),
    Mutant("stop_inside_run_ignored", StopInsideRunIgnored, spec="eagle"),
    Mutant("retract_filter_positional", RetractFilterPositional, spec="eagle"),
    Mutant("stale_result_applied", StaleResultApplied, spec="eagle-v2"),
    Mutant("abort_leaks_reservation", AbortLeaksReservation, spec="eagle-v2"),
    Mutant("late_commit", LateCommit, spec="eagle-v2"),
    Mutant("mtp_all_finish_leaves_verify_input", MTPAllFinishLeavesVerifyInput, spec="mtp"),
    Mutant("frozen_draft_writes_kv", FrozenDraftWritesKV, spec="mtp"),
    Mutant("stale_padded_rows", StalePaddedRows, graphs="replay"),
    Mutant("bonus_tokens_not_restaged", BonusTokensNotRestaged, spec="mtp", graphs="replay"),
    Mutant("extend_padding_not_restaged", ExtendPaddingNotRestaged, spec="eagle",
           graphs="replay"),
    Mutant("seed_ignored", SeedIgnored),
    Mutant("seed_by_batch_row", SeedByBatchRow, spec="eagle"),
    Mutant("stop_string_at_run_end", StopStringAtRunEnd, spec="eagle"),
    Mutant("draft_position_shift", DraftPositionShift, spec="eagle"),
    Mutant("tree_wrong_parent", TreeWrongParent, spec="eagle-tree"),
    Mutant("draft_catch_up_skipped", DraftCatchUpSkipped, spec="draft-model"),
    Mutant("verify_ignores_top_p", VerifyIgnoresTopP, spec="eagle"),
    Mutant("verify_temperature_misapplied", VerifyTemperatureMisapplied, spec="eagle"),
    Mutant("draft_skips_non_final_chunks", DraftSkipsNonFinalChunks, spec="eagle",
           killed_by="test_golden.py::test_chunked_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("session_drops_draft_kv", SessionDropsDraftKV, spec="eagle",
           killed_by="test_golden.py::test_session_acceptance_matches_golden[chain-s3-n4]"),
]}


class MutantBackend(RefEngineBackend):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"
        self.engine_class = mutant.engine_class

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        if self.mutant.graphs is not None and cfg.graph_executor is None:
            cfg = replace(cfg, graph_executor=self.mutant.graphs)
        return super().open(cfg)


def mutant_backend(name: str) -> MutantBackend:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})")
    return MutantBackend(MUTANTS[name])
