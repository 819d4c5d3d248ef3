"""A certificate's passes are the backend's: the suite's self-checks are reported apart, and a
tier that compared nothing says not applicable (T5 of the honest-verdict work)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.report.certificate import SelfCheck, build_certificate
from conformance.report.markdown import render_markdown
from conformance.report.results import CheckRow
from conformance.report.verdict import vacuous_reason
from tests.test_report import results, row

CONTROL = "test_distribution.py::test_negative_control_is_rejected[top-p]"


def self_check(outcome: str, message: str = "") -> CheckRow:
    return replace(row(CONTROL, "distribution", outcome, message), self_check=True)


def test_self_checks_are_not_counted_as_the_backends_passes() -> None:
    cert = build_certificate(results([row("test_lossless.py::a", "lossless", "passed"),
                                      self_check("passed")]))
    assert cert.status == "passed"
    assert [t.tier for t in cert.tiers] == ["lossless"] and cert.total_checks == 1
    assert cert.self_checks == [SelfCheck(CONTROL, "passed", "")]
    md = render_markdown(cert)
    assert "## Suite self-checks" in md and f"| `{CONTROL}` | passed | — |" in md


def test_a_failed_self_check_fails_the_run() -> None:
    cert = build_certificate(results([row("test_lossless.py::a", "lossless", "passed"),
                                      self_check("failed", "power 0.2 < 0.9")]))
    assert cert.status == "failed" and cert.failures == []
    assert "| failed | power 0.2 < 0.9 |" in render_markdown(cert)


def test_a_run_whose_only_passes_are_self_checks_is_vacuous() -> None:
    rows = [row("test_memory.py::b", "memory", "not claimed", "Skipped: not claimed: x"),
            self_check("passed")]
    assert vacuous_reason(rows) == "all 1 checks were skipped or not claimed"
    assert vacuous_reason([self_check("passed")]) == "all 1 checks are the suite's self-checks"
    assert vacuous_reason([]) == "zero checks collected"


def test_kernel_tier_on_cpu_and_self_checks_reported_as_what_they_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real certify: refengine's Triton kernels cannot run on this CPU without the
    interpreter, so the kernel tier is not applicable (it used to compare the torch references
    with themselves and pass); the power self-check passes apart from the backend's checks."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    power = "test_distribution.py::test_verify_param_bugs_have_power[verify_ignores_top_p]"
    code = main(["certify", "--spec", "eagle", "-n", "0", "--report", str(tmp_path), "--only",
                 f"{power},test_kernel.py::test_verify_greedy_published_vector,"
                 "test_lifecycle.py::test_max_new_tokens[1]"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report.json").read_text())
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert set(tiers) == {"kernel", "lifecycle"}, tiers
    assert tiers["kernel"]["status"] == "skipped" and tiers["kernel"]["counts"]["passed"] == 0
    [why] = tiers["kernel"]["not_run"]
    assert why.startswith("skipped: not applicable: the backend's triton kernels cannot run "
                          "here"), why
    assert report["self_checks"] == [{"check": power, "outcome": "passed", "message": ""}]
    assert "suite self-checks (not the backend's; not counted above): 1 passed" in out
    assert report["threads"] == [1] and report["environment"]["threads per check"] == "1"
