"""The headline says how much ran, and ``--require`` fails a run whose coverage class was not
met (conformance.report.coverage)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.backends.refengine import RefEngineBackend
from conformance.contract import Capabilities
from conformance.report.coverage import CLASS_NAMES, coverage
from conformance.report.results import CheckRow
from tests.test_cli import run

EVERYTHING = Capabilities(algorithms=frozenset({"none", "eagle"}), stepwise=True, abort=True,
                          sampling=True, seeded_sampling=True, memory_view=True,
                          acceptance_stats=True, reference_draft=True, sessions=True)


def row(requires: str, outcome: str, message: str = "") -> CheckRow:
    return CheckRow("test_x.py::check", "x", outcome, requires=requires, message=message)


def test_every_check_run_is_full() -> None:
    checks = [row("algorithm:eagle", "passed"), row("algorithm:eagle,memory_view", "passed"),
              row("algorithm:eagle,sessions", "passed"),
              row("algorithm:eagle,reference_draft,acceptance_stats", "skipped",
                  "not applicable: no trace")]
    cov = coverage(checks, EVERYTHING)
    assert (cov.ran, cov.total, cov.not_claimed, cov.not_applicable) == (3, 4, 0, 1)
    assert cov.met == "full" and cov.gaps == {}
    assert cov.describe() == "3 of 4 checks ran; 1 not applicable"


def test_classes_nest_and_say_what_they_lack() -> None:
    claims = replace(EVERYTHING, sessions=False, reference_draft=True)
    checks = [row("algorithm:eagle", "passed"), row("algorithm:eagle,abort", "passed"),
              row("algorithm:eagle,sessions", "not claimed", "not claimed: sessions"),
              row("algorithm:eagle,reference_draft,acceptance_stats", "not claimed",
                  "Skipped: not claimed: reference_draft under chain-s3-n4 (converted head)")]
    cov = coverage(checks, claims)
    assert cov.met == "serving"
    assert cov.missing == {"sessions": 1, "reference_draft": 1}
    assert "reference_draft" in cov.gaps["speculation"]
    assert cov.unmet("serving") is None and cov.unmet("outputs") is None
    assert cov.unmet("full") == ("coverage class 'full' not met: checks it needs were not "
                                 "claimed (reference_draft, sessions)")
    # a class whose checks were all not applicable is not met either: nothing of it ran
    skipped = coverage([row("algorithm:eagle", "skipped")], EVERYTHING)
    assert skipped.met is None and skipped.gaps["outputs"] == "none of its checks ran"


class PlainOnlyMinimal(RefEngineBackend):
    """The least a backend can claim: plain decoding, no other capability."""

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none"}))


def minimal() -> PlainOnlyMinimal:
    return PlainOnlyMinimal()


@pytest.mark.parametrize("require, code", [(None, 0), ("outputs", 0), ("serving", 1)])
def test_a_minimal_backend_headline_and_require(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, require: str | None,
        code: int) -> None:
    report = tmp_path / "r"
    args = ["certify", "--backend", "tests.test_coverage:minimal", "--spec", "none",
            "-n", "0", "--report", str(report), "-k", "lossless or lifecycle or memory"]
    got, out, _ = run(capsys, *args, *(["--require", require] if require else []))
    assert got == code, out
    cert = json.loads((report / "report.json").read_text())
    cov = cert["coverage"]
    assert cov["met"] == "outputs" and cov["not_claimed"] > 0 and cov["ran"] < cov["total"]
    status = "PASSED" if code == 0 else "FAILED"
    line = next(line for line in out.splitlines() if line.startswith("none: "))
    assert line.startswith(f"none: {status} — {cov['ran']} of {cov['total']} checks ran; "
                           f"{cov['not_claimed']} not claimed ("), line
    # -k narrows the run, so the coverage is said to be of the checks selected only.
    assert line.endswith("; coverage: outputs (of the checks selected)"), line
    md = (report / "report.md").read_text()
    assert "## Coverage" in md and "| serving | no: checks it needs were not claimed (" in md
    if require == "serving":
        assert "FAILED --require serving: coverage class 'serving' not met" in out
        assert "memory_view" in out


def test_require_names_only_known_classes(capsys: pytest.CaptureFixture[str]) -> None:
    assert CLASS_NAMES == ("outputs", "serving", "speculation", "full")
    got, _, err = run(capsys, "certify", "--require", "most")
    assert got == 2 and "invalid choice: 'most'" in err
