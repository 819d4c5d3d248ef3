"""Backends that differ from the reference engine only where the adapter contract allows
(``tests/conforming_variants.py``) certify with no failed check: every check passes, or is not
claimed, or says why it does not apply. And a backend that claims a capability it does not
honour still fails the check that needs it.

The default run certifies each variant under plain decoding on the tiers where checks set up
preconditions between steps (lifecycle, memory, sessions); ``-m slow`` certifies each
on every spec, every tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.plan.run_plan import RunPlan
from conformance.plan.specs import SPECS
from conformance.run.suite import SuiteOptions, run_suite

VARIANTS = ("whole_prefill", "no_memory_view", "run_to_completion", "queueing",
            "queueing_lists_waiting", "fixed_pages", "no_abort")
PRECONDITION_TIERS = "test_lifecycle or test_memory or test_sessions"


def certify(tmp_path: Path, factory: str, spec: str, keyword: str | None = None,
            only: tuple[str, ...] = ()) -> dict[str, str]:
    """check id -> outcome, from a gate run of the suite against the variant."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = SuiteOptions(RunPlan(f"tests.conforming_variants:{factory}", (spec,),
                                keyword=keyword, only=only))
    run = run_suite(opts, tmp_path / "results.json")
    assert run.results is not None, run.problems
    return {c.nodeid: c.outcome for c in run.results.checks}


def assert_none_failed(outcomes: dict[str, str]) -> None:
    assert "passed" in outcomes.values(), outcomes
    failed = [check for check, outcome in outcomes.items() if outcome == "failed"]
    assert not failed, f"a conforming variant failed: {failed}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_certifies_where_preconditions_are_set_up(variant: str, tmp_path: Path) -> None:
    assert_none_failed(certify(tmp_path, variant, "none", PRECONDITION_TIERS))


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_certifies_on_every_spec(variant: str, spec: str, tmp_path: Path) -> None:
    assert_none_failed(certify(tmp_path, variant, spec))


def test_whole_prefill_is_not_failed_for_streaming_its_first_token(tmp_path: Path) -> None:
    """Abort while prefilling needs a request caught mid-prompt: gated on chunked_prefill, so
    the variant that prefills whole is not asked; one that claims the capability and prefills
    whole anyway fails it."""
    check = "test_lifecycle.py::test_abort[prefilling]"
    assert certify(tmp_path / "a", "whole_prefill", "none", only=(check,)) == {
        check: "not claimed"}
    assert certify(tmp_path / "b", "claims_chunked_prefill_without", "none",
                   only=(check,)) == {check: "failed"}


def test_no_abort_is_not_asked_to_abort_by_the_worker_tier(tmp_path: Path) -> None:
    """Emptying the draft state by aborting every request needs abort: gated on it, so the
    variant that cannot abort is not asked (the refused call failed it, and its scenario's
    refused replay was reported as replaying clean)."""
    check = "test_worker.py::test_filter_to_zero_rows_then_new_arrivals"
    assert certify(tmp_path, "no_abort", "eagle", only=(check,)) == {check: "not claimed"}
