"""Every bug-zoo mutant is killed by the check named for it (``killed_by``), run alone against
it under the mutant's spec: the suite's teeth, shown in the test run rather than only by
``specgate mutants`` (which stops at whichever check fails first).

A representative per bug class runs in the default test run; the rest are marked slow
(``tox -e slow``). Refengine passing the same checks is what every certify run shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.backends.mutants import MUTANTS
from conformance.backends.mutants.source_patches import SOURCE_MUTANTS
from conformance.plan.run_plan import RunPlan
from conformance.run.suite import SuiteOptions, run_suite

ZOO = {**MUTANTS, **SOURCE_MUTANTS}

# One per class of bug and killing tier, the cheapest of each.
REPRESENTATIVES = {
    "leak_on_finish",                  # leaked KV: memory tier
    "ignores_stop_token_ids",          # dropped stop condition: lifecycle
    "batch_leaks_across_rows",         # batch-dependent attention: lossless
    "all_finish_leaves_verify_input",  # speculative state machine: worker
    "stale_result_applied",            # overlap stale results: lifecycle in-flight cases
    "retract_requeued_at_back",        # retraction order and events: lifecycle (R1-R2)
    "late_commit",                     # what a session keeps: sessions
    "stop_turn_ends_with_eos",         # a stop-ended turn's kept context: sessions endings
    "aborts_retracted_session_turns",  # an abort nobody asked for: sessions, the driver
    "stale_padded_rows",               # graph padding: graph tier
    "room_counts_verify_block_only",   # KV need of the widest configuration: memory tier
    "ends_short_of_context_limit",     # the context limit: memory tier
    "ends_far_short_of_context_limit",  # the context limit: lossless, whatever is claimed
    "key_width_from_first_request",    # graph key width: lossless with the graph runner on
    "draft_position_shift",            # lossless acceptance regression: golden
    "tree_mask_wrong_when_n_is_s_plus_1",  # a rule keyed on a shape: lossless drawn shapes
    "draft_skips_non_final_chunks",    # a drafter that misses a chunk: golden chunked trace
    "seed_ignored",                    # seeds: reproducibility
    "ignores_temperature_and_seed",    # sampling settings dropped: reproducibility collisions
    "verify_ignores_top_p",            # sampled law: distribution
    "greedy_argmax_bf16",              # a bug in code the oracle shares: committed outputs
}


def test_every_mutant_names_its_killer() -> None:
    assert set(ZOO) >= REPRESENTATIVES
    unnamed = [name for name, m in ZOO.items() if not m.killed_by]
    assert not unnamed, f"mutants without killed_by: {unnamed}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in REPRESENTATIVES
                                               else pytest.mark.slow) for n in ZOO])
def test_mutant_is_killed_by_its_named_check(name: str, tmp_path: Path) -> None:
    mutant = ZOO[name]
    assert mutant.killed_by is not None
    opts = SuiteOptions(RunPlan(f"mutant:{name}", (mutant.spec,), only=(mutant.killed_by,)))
    run = run_suite(opts, tmp_path / "results.json")
    assert run.results is not None, run.problems
    rows = {c.nodeid: c for c in run.results.checks}
    assert mutant.killed_by in rows, (
        f"{name}: {mutant.killed_by} is no check of spec {mutant.spec} (ran: {sorted(rows)})")
    row = rows[mutant.killed_by]
    assert row.outcome == "failed", f"{name} survived {mutant.killed_by}: {row}"
