"""The results file (``conformance.report.results_json``): a real run's file loads into typed
results and writes back the same JSON; a file of another version, or with a field missing, of
the wrong type or an unknown outcome, is refused with one line naming the file and the field;
report.json reads back into the results it was built from (what ``report merge`` relies on)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import date
from pathlib import Path

import pytest

from conformance.contract import Capabilities
from conformance.plan.run_plan import RunPlan
from conformance.report.certificate import build_certificate
from conformance.report.results import (
    BackendIdentity,
    CheckRow,
    ConfigRecord,
    JsonValue,
    RunResults,
)
from conformance.report.results_json import (
    dump_results,
    jsonable,
    load_results,
    read_results,
    results_from_report,
)
from conformance.run.known_failures import KnownFailure, apply_known
from conformance.run.suite import SuiteOptions, run_suite

SELECTION = "test_max_new_tokens or test_stop"  # quick lifecycle checks, some failing


def synthetic() -> RunResults:
    """Results with a field of every kind set: a failure with its repro file, a self-check,
    progress lines, figures of nested JSON, known failures, certify's fields."""
    failed = CheckRow("test_a.py::two", "a", "failed", 1.25, "algorithm:none,abort", "boom",
                      {"tau": 2.5, "hist": {"1": 3}, "ties": ["r1"]}, threads=2,
                      repro="repro/two.json", repro_reproduces=None,
                      repro_not_replayed="timed out", progress=("specgate: compiled x",))
    rows = (CheckRow("test_a.py::one", "a", "passed", 0.5, "algorithm:none", ""), failed,
            CheckRow("test_d.py::power", "d", "passed", 0.1, "", "", self_check=True))
    made = RunResults(
        BackendIdentity("b", "1", "pkg:b", 1), Capabilities(abort=True), "none", "gate", rows,
        unclaimed_reasons={"sessions": "not yet"},
        configurations=(ConfigRecord("plain", {"algorithm": "none"}),), case_timeout=30.0,
        threads=(2,), graphs="replay", environment={"device": "cpu", "cuda": None,
                                                   "tf32_matmul": False},
        collected={"a": 2}, specgate_version="9.9", shard="1/2", selection="-k 'x'",
        require="outputs")
    return apply_known(made, [KnownFailure("test_a.py::two", "tracked", date(2026, 12, 31)),
                              KnownFailure("test_a.py::gone", "renamed")],
                       "kf.toml", True, date(2026, 6, 1))


def test_a_real_results_file_round_trips(tmp_path: Path, random_model_dir: Path) -> None:
    path = tmp_path / "results.json"
    plan = RunPlan("mutant:ignores_stop_token_ids", ("none",), model=str(random_model_dir),
                   keyword=SELECTION)
    run = run_suite(SuiteOptions(plan, repro_dir=str(tmp_path)), path)
    assert run.results is not None, run.problems
    results = read_results(path)
    assert results == run.results
    outcomes = {c.outcome for c in results.checks}
    assert {"passed", "failed"} <= outcomes, outcomes
    assert any(c.repro for c in results.checks if c.outcome == "failed")
    assert json.loads(dump_results(results)) == json.loads(path.read_text())
    assert load_results(dump_results(results), "again") == results


def test_every_field_round_trips() -> None:
    results = synthetic()
    assert load_results(dump_results(results), "results.json") == results


def test_a_row_leaves_out_what_it_does_not_have() -> None:
    row = jsonable(CheckRow("test_a.py::one", "a", "passed"))
    assert row == {"nodeid": "test_a.py::one", "tier": "a", "outcome": "passed",
                   "duration": 0.0, "requires": "", "message": "", "figures": {}}


def test_report_json_reads_back_as_the_results_it_was_built_from() -> None:
    results = synthetic()
    cert = build_certificate(results)
    back = results_from_report(json.loads(cert.to_json()))
    assert back.environment == cert.environment  # the run's, and what built the certificate
    # report.json has no ``collected``: only an interrupted run's tiers use it
    assert replace(back, environment=results.environment) == replace(results, collected={})


def _broken(change: str) -> str:
    """The synthetic results file with one thing broken (``change``: what)."""
    doc = json.loads(dump_results(synthetic()))
    row: dict[str, JsonValue] = doc["checks"][0]
    if change == "missing field":
        del doc["capabilities"]
    elif change == "missing row field":
        del row["nodeid"]
    elif change == "wrong type":
        row["duration"] = "slow"
    elif change == "a boolean for a count":
        doc["threads"] = [True]
    elif change == "unknown outcome":
        row["outcome"] = "maybe"
    elif change == "unknown capability":
        doc["capabilities"]["teleport"] = True
    elif change == "not an object":
        doc = [doc]
    elif change == "another version":
        doc["results_version"] = 2
    elif change == "no version":
        del doc["results_version"]
    return json.dumps(doc)


@pytest.mark.parametrize("change, needle", [
    ("missing field", "missing field 'capabilities'"),
    ("missing row field", "checks[0]: missing field 'nodeid'"),
    ("wrong type", "checks[0].duration: expected a number, got str 'slow'"),
    ("a boolean for a count", "threads[0]: expected an integer, got bool True"),
    ("unknown outcome", "checks[0].outcome: unknown outcome 'maybe'"),
    ("unknown capability", "capabilities: unknown capabilities teleport"),
    ("not an object", "expected an object, got list"),
    ("another version", "results_version 2 is not 1"),
    ("no version", "missing field 'results_version'"),
])
def test_a_malformed_file_is_refused_with_one_line(change: str, needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        load_results(_broken(change), "results.json")
    message = str(caught.value)
    assert message.startswith("results.json: ") and needle in message, message
    assert "\n" not in message


def test_a_file_that_is_not_json_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^results\.json: not JSON \(") as caught:
        load_results('{"results_version": 1,\n', "results.json")
    assert "\n" not in str(caught.value)
