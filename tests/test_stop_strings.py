"""Stop strings at every offset of an accepted run: the lifecycle check passes on the reference
engine under speculation and fails on the bug zoo's ``stop_string_at_run_end`` (stop strings
checked once per accepted run), whose stop tokens are still checked per token."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plugin import run_suite

pytest_plugins = ["pytester"]

TIER = Path(__file__).resolve().parents[1] / "conformance" / "suites" / "test_lifecycle.py"


def stop_checks(pytester: pytest.Pytester, backend: str) -> dict[str, str]:
    """The lifecycle tier's stop-token and stop-string offset checks under ``--spec eagle``
    (tiny-code, gate profile): check name -> outcome."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    _, results = run_suite(pytester, backend, Path("tiny-code"), "--specgate-spec", "eagle",
                           "-k", "at_every_offset", str(TIER))
    return {str(c["nodeid"]).rsplit("::", 1)[1]: str(c["outcome"]) for c in results["checks"]}


def test_the_reference_engine_stops_inside_runs(pytester: pytest.Pytester) -> None:
    got = stop_checks(pytester, "refengine")
    assert got == {"test_stop_token_at_every_offset": "passed",
                   "test_stop_string_at_every_offset": "passed"}, got


def test_a_stop_string_checked_at_run_end_fails(pytester: pytest.Pytester) -> None:
    got = stop_checks(pytester, "mutant:stop_string_at_run_end")
    assert got == {"test_stop_token_at_every_offset": "passed",
                   "test_stop_string_at_every_offset": "failed"}, got
