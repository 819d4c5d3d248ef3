"""The certificate: statuses, checks that did not run and why, interrupted runs, junit layout."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.contract import Capabilities
from conformance.report.certificate import build_certificate
from conformance.report.junit import indent_junit
from conformance.report.markdown import render_markdown
from conformance.report.results import BackendIdentity, CheckRow, RunResults
from conformance.report.summary import summary_markdown


def row(nodeid: str, tier: str, outcome: str, message: str = "") -> CheckRow:
    return CheckRow(nodeid, tier, outcome, 0.5, "algorithm:none", message)


def results(checks: list[CheckRow], interrupted: bool = False) -> RunResults:
    return RunResults(BackendIdentity("b", "1", "b"), Capabilities(), "none", "gate",
                      tuple(checks), interrupted=interrupted)


CHECKS = [row("test_lossless.py::a", "lossless", "passed"),
          row("test_memory.py::b", "memory", "not claimed",
              "Skipped: not claimed: stepwise, memory_view"),
          row("test_memory.py::c", "memory", "not claimed",
              "Skipped: not claimed: stepwise, memory_view"),
          row("test_worker.py::d", "worker", "skipped",
              "Skipped: plain decoding has no speculative worker")]


def test_checks_that_did_not_run_are_listed_with_their_reason() -> None:
    cert = build_certificate(results(CHECKS))
    assert cert.status == "passed" and not cert.interrupted
    tiers = {t.tier: t for t in cert.tiers}
    assert tiers["memory"].status == "not claimed" and tiers["worker"].status == "skipped"
    assert tiers["memory"].not_run == {"not claimed: stepwise, memory_view": 2}
    md = render_markdown(cert)
    assert "| memory | 2 | not claimed: stepwise, memory_view |" in md
    assert "| worker | 1 | skipped: plain decoding has no speculative worker |" in md
    assert "INCOMPLETE" not in md


def test_an_interrupted_run_is_incomplete_never_passed() -> None:
    cert = build_certificate(results(CHECKS[:1], interrupted=True))
    assert cert.status == "incomplete" and cert.vacuous is None and cert.total_checks == 1
    md = render_markdown(cert)
    assert "**INCOMPLETE (interrupted)**" in md and "covers the 1 checks" in md
    assert "INCOMPLETE (interrupted)" in summary_markdown([cert])


def test_an_interrupted_run_with_no_finished_check_is_still_incomplete() -> None:
    cert = build_certificate(results([], interrupted=True))
    assert cert.status == "incomplete" and cert.total_checks == 0


def test_junit_is_indented_and_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite tests="1" failures="0"><testcase name="a"/>'
                    "</testsuite></testsuites>")
    indent_junit(path)
    text = path.read_text()
    assert len(text.splitlines()) >= 4
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "1" and len(suite) == 1
