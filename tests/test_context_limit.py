"""The context limit in every profile and for every backend: the lossless tier runs a request
to the model's context limit, so a backend without a memory view (which the memory tier's
to-limit check never opens) still has its length check at the limit checked. A conforming
backend without one passes it; ``ends_far_short_of_context_limit`` without one fails it."""

from __future__ import annotations

from pathlib import Path

from conforming_variants import NoMemoryViewBackend

from conformance.backends.mutants import MUTANTS
from conformance.backends.mutants.context_limit import EndsFarShortOfContextLimit
from conformance.plan.run_plan import RunPlan
from conformance.report.results import CheckRow
from conformance.run.suite import SuiteOptions, run_suite

TO_LIMIT = "test_past_context_boundary and ctx2048"


class FarShortWithoutMemoryView(NoMemoryViewBackend):
    """``ends_far_short_of_context_limit`` keeping its KV accounting to itself."""

    name = "far-short-without-memory-view"
    engine_class = EndsFarShortOfContextLimit


def far_short_without_memory_view() -> FarShortWithoutMemoryView:
    return FarShortWithoutMemoryView()


def _to_limit(tmp_path: Path, backend: str) -> dict[str, CheckRow]:
    """The gate's to-limit checks on ``backend``, plain decoding: check id -> its row."""
    run = run_suite(SuiteOptions(RunPlan(backend, ("none",), keyword=TO_LIMIT)),
                    tmp_path / "results.json")
    assert run.results is not None, run.problems
    return {c.nodeid: c for c in run.results.checks}


def test_a_backend_without_memory_view_passes_the_gates_to_limit_check(tmp_path: Path) -> None:
    """The memory tier's to-limit check does not run for it (not claimed); the lossless
    tier's do, and pass."""
    checks = _to_limit(tmp_path, "tests.conforming_variants:no_memory_view")
    outcomes = {k: c.outcome for k, c in checks.items()}
    assert outcomes == {
        "test_lossless.py::test_past_context_boundary[plain-ctx2048-no-retract]": "passed",
        "test_lossless.py::test_past_context_boundary[plain-ctx2048-retract]": "passed",
    }, checks


def test_ending_64_short_of_the_limit_fails_without_memory_view(tmp_path: Path) -> None:
    checks = _to_limit(tmp_path, "tests.test_context_limit:far_short_without_memory_view")
    lossless = {k: c for k, c in checks.items() if k.startswith("test_lossless.py")}
    assert lossless and {c.outcome for c in lossless.values()} == {"failed"}, checks
    assert all("to-limit-2048" in c.message and "expected more" in c.message
               for c in lossless.values()), [c.message for c in lossless.values()]
    assert MUTANTS["ends_far_short_of_context_limit"].killed_by == (
        "test_lossless.py::test_past_context_boundary[plain-ctx2048-no-retract]")
