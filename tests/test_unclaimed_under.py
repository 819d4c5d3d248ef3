"""``unclaimed_under``: a capability a backend claims, but not under one configuration, makes
the checks needing it "not claimed" for that configuration alone, with the backend's reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.backends.refengine import RefEngineBackend
from conformance.contract import SpecConfig, unclaimed_under
from conformance.plan.run_plan import RunPlan
from conformance.plan.specs import SPECS, config_id
from conformance.run.suite import SuiteOptions, run_suite

S5, S3 = SPECS["eagle"].configs[1], SPECS["eagle"].configs[0]
WHY = "this head drafts differently at five steps"


class NotAtFiveSteps(RefEngineBackend):
    """The reference engine, saying its drafts are not the reference's at S=5."""

    def unclaimed_under(self, spec: SpecConfig) -> dict[str, str]:
        return {"reference_draft": WHY} if spec.num_steps == 5 else {}


def not_at_five_steps() -> NotAtFiveSteps:
    return NotAtFiveSteps()


class Says(RefEngineBackend):
    def __init__(self, reasons: dict[str, object]) -> None:
        self.reasons = reasons

    def unclaimed_under(self, spec: SpecConfig) -> dict[str, object]:
        return self.reasons


def test_reasons_are_validated() -> None:
    assert unclaimed_under(RefEngineBackend(), S5) == {}
    assert unclaimed_under(NotAtFiveSteps(), S5) == {"reference_draft": WHY}
    assert unclaimed_under(NotAtFiveSteps(), S3) == {}
    for reasons, says in [({"no_such_flag": "x"}, "not a capability flag"),
                          ({"algorithm:eagle": "x"}, "not a capability flag"),
                          ({"reference_draft": "two\nlines"}, "one-line reason"),
                          ({"reference_draft": " "}, "one-line reason"),
                          ({"reference_draft": 3}, "one-line reason")]:
        with pytest.raises(ValueError, match=says):
            unclaimed_under(Says(reasons), S5)


def test_an_unclaimed_flag_is_refused_as_an_exception() -> None:
    """Only a claimed flag can have an exception: an unclaimed one is not claimed anywhere."""
    from dataclasses import replace

    class Unclaimed(Says):
        def capabilities(self):  # type: ignore[no-untyped-def]
            return replace(super().capabilities(), reference_draft=False)

    with pytest.raises(ValueError, match="not a capability flag the backend claims"):
        unclaimed_under(Unclaimed({"reference_draft": "x"}), S5)


def test_the_check_is_not_claimed_under_that_configuration_alone(tmp_path: Path) -> None:
    node = f"test_golden.py::test_acceptance_matches_golden[{config_id(S5)}]"
    run = run_suite(SuiteOptions(RunPlan("tests.test_unclaimed_under:not_at_five_steps",
                                         ("eagle",), only=(node,))), tmp_path / "results.json")
    assert run.results is not None, run.problems
    (row,) = run.results.checks
    assert row.outcome == "not claimed"
    assert f"reference_draft under {config_id(S5)} ({WHY})" in row.message
