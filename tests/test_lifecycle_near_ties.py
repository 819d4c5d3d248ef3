"""The lifecycle tier's exact-token checks (stops placed on the reference's output, the tokens
an aborted request streamed) follow the lossless tier's near-tie rule: a backend whose output
leaves the reference's at a near-tie for its declared precision passes them, the near-tie
listed (a stop check with nothing left to compare says it does not apply); a token that leaves
it anywhere else still fails them."""

from __future__ import annotations

from pathlib import Path

from conformance.plan.run_plan import RunPlan
from conformance.report.results import CheckRow
from conformance.run.suite import SuiteOptions, run_suite

STOP_CHECKS = ("test_lifecycle.py::test_stop_at_first_token",
               "test_lifecycle.py::test_stop_token_at_every_offset",
               "test_lifecycle.py::test_stop_string_at_every_offset")


def checks(tmp_path: Path, backend: str, spec: str, keyword: str | None = None,
           only: tuple[str, ...] = ()) -> dict[str, CheckRow]:
    """check id -> its results row, from a gate run of the suite against ``backend``."""
    opts = SuiteOptions(RunPlan(backend, (spec,), keyword=keyword, only=only))
    run = run_suite(opts, tmp_path / "results.json")
    assert run.results is not None, run.problems
    return {c.nodeid: c for c in run.results.checks}


def test_a_bfloat16_backend_passes_the_lifecycle_tier(tmp_path: Path) -> None:
    """The reference engine in bfloat16, declaring it: under EAGLE the request aborted while
    decoding streams a token the float32 reference ranks second at a near-tie (an exact
    comparison failed it)."""
    rows = checks(tmp_path, "tests.test_near_ties:bfloat16_honest", "eagle", "test_lifecycle")
    failed = {k: r.message for k, r in rows.items() if r.outcome == "failed"}
    assert not failed, failed
    ties = rows["test_lifecycle.py::test_abort[decoding]"].figures.get("near_ties")
    assert isinstance(ties, list) and any(str(t).startswith("victim@") for t in ties), ties


def test_a_flip_at_a_near_tie_before_a_stop_is_not_compared(tmp_path: Path) -> None:
    """The first prompt's first output token is a near-tie in bfloat16: a backend reporting the
    runner-up there continues another prefix, so no placed stop can be compared."""
    rows = checks(tmp_path, "tests.test_near_ties:flips_near_ties", "none", only=STOP_CHECKS)
    assert set(rows) == set(STOP_CHECKS), sorted(rows)
    for check, row in rows.items():
        assert row.outcome == "skipped", (check, row)
        assert "near-tie before its stop" in row.message, (check, row)
        assert row.figures["near_ties"], (check, row)


def test_a_confident_flip_before_a_stop_fails(tmp_path: Path) -> None:
    """A flip where the reference is sure (at least twice the epsilon) is no near-tie: the
    stops placed after it fail."""
    rows = checks(tmp_path, "tests.test_near_ties:flips_confident_tokens", "none",
                  only=STOP_CHECKS[1:])
    assert {k: r.outcome for k, r in rows.items()} == dict.fromkeys(STOP_CHECKS[1:],
                                                                       "failed"), rows
