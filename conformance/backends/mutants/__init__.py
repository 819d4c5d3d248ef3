"""The bug zoo: the reference engine with one real bug class planted, as a backend.

Each mutant is the engine with one component class replaced (scheduler, KV manager, model
runner, graph runner, output processor, speculative worker or its draft state) by a subclass
overriding a single method (or naming a broken part of its own: the graph runner's staging);
nothing here is a flag in the production path, and no mutant overrides a method of the engine
itself. ``specgate mutants`` runs the suite against every mutant, and every one must be
killed by some check: a suite that cannot kill its mutants has no teeth. Wherever a backend is
named, a mutant is ``mutant:<name>``.

These model bug classes from production engines (``docs/bug-classes.md``): leaked KV, leaked
request rows, stale state after retraction, retractions unreported or re-queued behind later
arrivals, off-by-one length checks, dropped stop conditions,
ignored sampling seeds, batch-dependent attention, stale graph padding (a mutant that opens
with the graph runner on, ``Mutant.graphs``), lossless draft-side regressions that only
acceptance shows (the golden tier's per-step check; n-gram contexts missing tokens among
them); and speculative-sampling bugs that only show in the distribution of sampled tokens:
``biased_verify_sampler`` (the distribution tier's negative control), verify paths that
misapply top-p or temperature; and verify rows given a batch neighbour's sampling
parameters, which shows only where a batch mixes settings; and the EAGLE-3 head's math
(its taps, their fusion order, its vocabulary map and mask, the halves of its doubled
input, its draft-extend positions), which only acceptance shows. Mutants of shared code
written as source patches live in ``source_patches.py``. A mutant with ``spec`` other than
"none" behaves exactly like the reference engine under plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from conformance.backends.mutants.acceptance import (
    DraftAfterRetractFromPromptFeature,
    DraftSkipsNonFinalChunks,
    SessionDropsDraftKV,
)
from conformance.backends.mutants.context_limit import (
    EndsFarShortOfContextLimit,
    EndsShortOfContextLimit,
)
from conformance.backends.mutants.eagle3 import (
    Eagle3DoubledInputSwapped,
    Eagle3DraftMapOffByOne,
    Eagle3ExtendAtTargetPositions,
    Eagle3OffVocabularyNotMasked,
    Eagle3TapsFusedReversed,
    Eagle3TapsOneLayerEarly,
)
from conformance.backends.mutants.graph import (
    BonusTokensNotRestaged,
    ExtendPaddingNotRestaged,
    GraphWalkBonusAfterRoot,
    KeyWidthFromFirstRequest,
    KeyWidthIgnoresNewTokens,
    StalePaddedRows,
    StepRootNotRestaged,
)
from conformance.backends.mutants.lifecycle import (
    BatchLeaksAcrossRows,
    IgnoresStopTokenIds,
    MaxNewTokensOffByOne,
    SeedIgnored,
    StopAtFirstListedString,
)
from conformance.backends.mutants.memory import (
    AbortLeaksRow,
    AbortStaysRunning,
    LeakOnFinish,
    RetractStaleCommitted,
    RoomCountsVerifyBlockOnly,
)
from conformance.backends.mutants.ngram import NgramContextFromLastChunk, NgramContextSkipsBonus
from conformance.backends.mutants.overlap import (
    AbortLeaksReservation,
    LateCommit,
    StaleResultApplied,
)
from conformance.backends.mutants.retraction import RetractRequeuedAtBack, RetractUnreported
from conformance.backends.mutants.sampling import (
    BiasedVerifySampler,
    IgnoresTemperatureAndSeed,
    VerifyIgnoresTopP,
    VerifyParamsFromPreviousRow,
    VerifyTemperatureMisapplied,
    VerifyTopKAloneAtBatchMax,
)
from conformance.backends.mutants.sessions import (
    AbortsRetractedSessionTurns,
    StopRunNotCompacted,
    StopTurnEndsWithEOS,
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
from conformance.backends.mutants.tree_shape import TreeMaskWrongWhenNIsSPlus1
from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import Backend, OpenConfig
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
    Mutant("leak_on_finish", LeakOnFinish,
           killed_by="test_memory.py::test_invariants_under_pressure[plain-1]"),
    Mutant("abort_leaks_row", AbortLeaksRow, killed_by="test_lifecycle.py::test_abort[decoding]"),
    Mutant("abort_stays_running", AbortStaysRunning,
           killed_by="test_lifecycle.py::test_abort_frees_the_only_running_slot"),
    Mutant("retract_stale_committed", RetractStaleCommitted,
           killed_by="test_lifecycle.py::test_retract_middle_request"),
    Mutant("retract_requeued_at_back", RetractRequeuedAtBack,
           killed_by="test_lifecycle.py::test_retracted_request_is_not_overtaken"),
    Mutant("retract_unreported", RetractUnreported,
           killed_by="test_lifecycle.py::test_retract_the_only_request"),
    Mutant("max_new_tokens_off_by_one", MaxNewTokensOffByOne,
           killed_by="test_lifecycle.py::test_max_new_tokens[1]"),
    Mutant("ignores_stop_token_ids", IgnoresStopTokenIds,
           killed_by="test_lifecycle.py::test_stop_at_first_token"),
    Mutant("stop_at_first_listed_string", StopAtFirstListedString,
           killed_by="test_lifecycle.py::test_earliest_of_several_stop_strings"),
    Mutant("batch_leaks_across_rows", BatchLeaksAcrossRows,
           killed_by="test_lossless.py::test_batch_of_mixed_lengths[plain-8]"),
    Mutant("biased_verify_sampler", BiasedVerifySampler,
           spec="eagle",
           killed_by="test_distribution.py::test_sampled_tokens_follow_target_distribution[top-p]"),
    Mutant("all_finish_leaves_verify_input", AllFinishLeavesVerifyInput,
           spec="eagle",
           killed_by="test_worker.py::test_all_finish_inside_verify_installs_idle_then_merges"),
    Mutant("draft_extend_phase_confusion", DraftExtendPhaseConfusion,
           spec="eagle", killed_by="test_golden.py::test_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("rejected_slots_kept_paged", RejectedSlotsKeptPaged,
           spec="eagle",
           killed_by="test_memory.py::test_invariants_under_pressure[chain-s5-n6-4]"),
    Mutant("stop_inside_run_ignored", StopInsideRunIgnored,
           spec="eagle", killed_by="test_lifecycle.py::test_stop_token_at_every_offset"),
    Mutant("retract_filter_positional", RetractFilterPositional,
           spec="eagle",
           killed_by="test_lossless.py::test_forced_retraction_every_3_steps[chain-s3-n4-1]"),
    Mutant("stale_result_applied", StaleResultApplied,
           spec="eagle-v2", killed_by="test_lifecycle.py::test_finish_while_step_in_flight"),
    Mutant("abort_leaks_reservation", AbortLeaksReservation,
           spec="eagle-v2", killed_by="test_lifecycle.py::test_abort_while_step_in_flight"),
    Mutant("late_commit", LateCommit,
           spec="eagle-v2",
           killed_by="test_sessions.py::test_session_turns[no-retract-no-abort-1]"),
    Mutant("mtp_all_finish_leaves_verify_input", MTPAllFinishLeavesVerifyInput,
           spec="mtp",
           killed_by="test_worker.py::test_all_finish_inside_verify_installs_idle_then_merges"),
    Mutant("frozen_draft_writes_kv", FrozenDraftWritesKV,
           spec="mtp",
           killed_by="test_lossless.py::test_greedy_matches_reference[mtp-chain-s3-n4-batch-1]"),
    Mutant("stale_padded_rows", StalePaddedRows,
           graphs="replay", killed_by="test_graph.py::test_padded_rows_follow_the_policy"),
    Mutant("bonus_tokens_not_restaged", BonusTokensNotRestaged,
           spec="mtp",
           graphs="replay",
           killed_by="test_graph.py::test_graph_matches_eager_at_every_size"),
    # Trees: a greedy chain step runs as one graph, past the separate extend and verify.
    Mutant("extend_padding_not_restaged", ExtendPaddingNotRestaged,
           spec="eagle-tree",
           graphs="replay",
           killed_by="test_golden.py::test_acceptance_matches_golden[tree-s3-k4-n8]"),
    Mutant("graph_walk_bonus_after_root", GraphWalkBonusAfterRoot,
           spec="eagle-tree",
           graphs="replay",
           killed_by="test_lossless.py::test_greedy_matches_reference[tree-s3-k4-n8-batch-1]"),
    Mutant("step_root_not_restaged", StepRootNotRestaged,
           spec="eagle",
           graphs="replay",
           killed_by="test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-1]"),
    Mutant("key_width_ignores_new_tokens", KeyWidthIgnoresNewTokens, graphs="replay",
           killed_by="test_graph.py::test_graph_matches_eager_either_side_of_every_key_width"),
    Mutant("key_width_from_first_request", KeyWidthFromFirstRequest, graphs="replay",
           killed_by="test_lossless.py::test_graph_runner_across_key_widths"),
    Mutant("seed_ignored", SeedIgnored,
           killed_by="test_reproducibility.py::test_seed_fixes_the_stream_whatever_the_batch"),
    Mutant("seed_by_batch_row", SeedByBatchRow,
           spec="eagle",
           killed_by="test_reproducibility.py::test_seed_fixes_the_stream_whatever_the_batch"),
    Mutant("stop_string_at_run_end", StopStringAtRunEnd,
           spec="eagle", killed_by="test_lifecycle.py::test_stop_string_at_every_offset"),
    Mutant("draft_position_shift", DraftPositionShift,
           spec="eagle", killed_by="test_golden.py::test_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("tree_wrong_parent", TreeWrongParent,
           spec="eagle-tree",
           killed_by="test_golden.py::test_acceptance_matches_golden[tree-s3-k4-n8]"),
    Mutant("tree_mask_wrong_when_n_is_s_plus_1", TreeMaskWrongWhenNIsSPlus1,
           spec="eagle-tree",
           killed_by="test_lossless.py::test_drawn_shape_matches_reference[tree-s3-k2-n4]"),
    Mutant("draft_catch_up_skipped", DraftCatchUpSkipped,
           spec="draft-model",
           killed_by="test_golden.py::test_acceptance_matches_golden[draft-n4]"),
    Mutant("verify_ignores_top_p", VerifyIgnoresTopP,
           spec="eagle",
           killed_by="test_distribution.py::test_sampled_tokens_follow_target_distribution[top-p]"),
    Mutant("verify_temperature_misapplied", VerifyTemperatureMisapplied,
           spec="eagle",
           killed_by="test_distribution.py::test_sampled_tokens_follow_target_distribution[top-k-top-p]"),
    Mutant("verify_params_from_previous_row", VerifyParamsFromPreviousRow,
           spec="eagle",
           killed_by="test_reproducibility.py::test_seed_fixes_the_stream_whatever_the_batch"),
    Mutant("verify_top_k_alone_at_batch_max", VerifyTopKAloneAtBatchMax,
           spec="eagle",
           killed_by="test_reproducibility.py::test_seed_fixes_the_stream_with_top_k_alone"),
    Mutant("stop_turn_ends_with_eos", StopTurnEndsWithEOS,
           killed_by="test_sessions.py::test_turns_ending_by_stop"),
    Mutant("stop_run_not_compacted", StopRunNotCompacted, spec="eagle-tree",
           killed_by="test_sessions.py::test_turns_ending_by_stop"),
    Mutant("aborts_retracted_session_turns", AbortsRetractedSessionTurns,
           killed_by="test_sessions.py::test_session_turns[retract-no-abort-1]"),
    Mutant("room_counts_verify_block_only", RoomCountsVerifyBlockOnly, spec="eagle-tree",
           killed_by="test_memory.py::test_invariants_under_pressure[tree-s5-k8-n16-1]"),
    Mutant("ends_short_of_context_limit", EndsShortOfContextLimit,
           killed_by="test_memory.py::test_invariants_past_context_boundary[plain-ctx2048]"),
    Mutant("ends_far_short_of_context_limit", EndsFarShortOfContextLimit,
           killed_by="test_lossless.py::test_past_context_boundary[plain-ctx2048-no-retract]"),
    Mutant("ignores_temperature_and_seed", IgnoresTemperatureAndSeed,
           killed_by="test_reproducibility.py::test_different_seeds_give_different_streams"),
    Mutant("draft_skips_non_final_chunks", DraftSkipsNonFinalChunks, spec="eagle",
           killed_by="test_golden.py::test_chunked_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("session_drops_draft_kv", SessionDropsDraftKV, spec="eagle",
           killed_by="test_golden.py::test_session_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("draft_after_retract_from_prompt_feature", DraftAfterRetractFromPromptFeature,
           spec="eagle",
           killed_by="test_golden.py::test_retraction_acceptance_matches_golden[chain-s3-n4]"),
    Mutant("ngram_context_skips_bonus", NgramContextSkipsBonus, spec="ngram",
           killed_by="test_golden.py::test_acceptance_matches_golden[ngram-n4]"),
    Mutant("ngram_context_from_last_chunk", NgramContextFromLastChunk, spec="ngram",
           killed_by="test_golden.py::test_chunked_acceptance_matches_golden[ngram-n4]"),
    Mutant("eagle3_taps_one_layer_early", Eagle3TapsOneLayerEarly, spec="eagle3",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-chain-s3-n4]"),
    Mutant("eagle3_taps_fused_reversed", Eagle3TapsFusedReversed, spec="eagle3",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-chain-s3-n4]"),
    Mutant("eagle3_draft_map_off_by_one", Eagle3DraftMapOffByOne, spec="eagle3",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-chain-s3-n4]"),
    Mutant("eagle3_off_vocabulary_not_masked", Eagle3OffVocabularyNotMasked, spec="eagle3-tree",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-tree-s3-k4-n8]"),
    Mutant("eagle3_doubled_input_swapped", Eagle3DoubledInputSwapped, spec="eagle3",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-chain-s3-n4]"),
    Mutant("eagle3_extend_at_target_positions", Eagle3ExtendAtTargetPositions, spec="eagle3",
           killed_by="test_golden.py::test_acceptance_matches_golden[eagle3-chain-s3-n4]"),
]}


class MutantBackend(RefEngineBackend):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.name = f"mutant:{mutant.name}"
        self.engine_class = mutant.engine_class

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        if self.mutant.graphs is not None and cfg.graph_executor is None:
            # its bug lives in the graph runner: on a GPU, the CUDA graphs it runs there
            cfg = replace(cfg, graph_executor=self.mutant.graphs if cfg.device == "cpu"
                          else "cuda")
        return super().open(cfg)


def mutant_backend(name: str) -> MutantBackend:
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r} (known: {', '.join(MUTANTS)})")
    return MutantBackend(MUTANTS[name])


def load_mutant(name: str, launcher: bool) -> Backend:
    """The mutant ``name`` (a class mutant or a source-patch mutant); ``launcher`` as in
    ``conformance.plan.registry.load_backend``. An unknown name raises ``ValueError``."""
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS, source_mutant_backend

    if name in SOURCE_MUTANTS:
        return source_mutant_backend(name, launcher)
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r} (known: "
                         f"{', '.join([*MUTANTS, *SOURCE_MUTANTS])})")
    return mutant_backend(name)
