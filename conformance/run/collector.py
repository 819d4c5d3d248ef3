"""The results of a suite run: one ``CheckRow`` per suite check, collected on the xdist
controller (or the only process) from the properties each check's reports carry, the
vacuous-run guard applied at the end of the session, and the ``RunResults`` written to the
results file ``specgate certify`` turns into a certificate
(``conformance.report.results_json``)."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from conformance.contract import unclaimed_reasons
from conformance.contract.versions import declared_version
from conformance.report.certified import config_record
from conformance.report.environment import run_environment
from conformance.report.progress import tier_of
from conformance.report.results import BackendIdentity, CheckRow, RunResults
from conformance.report.results_json import dump_results, json_value
from conformance.report.verdict import NOT_CLAIMED, vacuous_reason
from conformance.run.case_timeout import native_grace
from conformance.run.context import case_timeout, context
from conformance.run.native_watchdog import WORKER_INPUT_KEY, crash_message

Properties = list[tuple[str, object]]  # a report's user_properties, as pytest holds them


class WorkerNode(Protocol):
    """An xdist worker as its controller configures it (xdist ships no types)."""

    workerinput: dict[str, Any]


def _message(report: pytest.TestReport) -> str:
    """A check's row message: why it failed, or why it was skipped."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.failed and crash is not None:
        return str(crash.message)[:800]
    if report.failed:
        return report.longreprtext.strip()[-800:]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    return ""


def _outcome(report: pytest.TestReport) -> str:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        return NOT_CLAIMED if reason.startswith(f"Skipped: {NOT_CLAIMED}") else "skipped"
    return "passed" if report.passed else "failed"


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def check_row(report: pytest.TestReport, props: Properties, outcome: str, message: str
              ) -> CheckRow:
    """A check's row: its report's outcome and time, and what its properties say (the plugin's
    ``specgate_*`` ones, the rest being the figures it recorded)."""
    found = dict(props)
    threads, reproduces = found.get("specgate_threads"), found.get("specgate_repro_reproduces")
    return CheckRow(
        nodeid=report.nodeid, tier=str(found["specgate_tier"]), outcome=outcome,
        duration=round(report.duration, 3), requires=str(found.get("specgate_requires", "")),
        message=message,
        figures={k: json_value(v, f"{report.nodeid}: figure {k}") for k, v in found.items()
                 if not k.startswith("specgate_")},
        self_check=bool(found.get("specgate_self_check")),
        threads=threads if isinstance(threads, int) else None,
        repro=_text(found.get("specgate_repro")),
        repro_reproduces=reproduces if isinstance(reproduces, bool) else None,
        repro_not_replayed=_text(found.get("specgate_repro_not_replayed")))


class ResultCollector:
    """Collects one row per suite check (on the xdist controller, or the only process) and
    applies the vacuous-run guard at the end of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: dict[str, CheckRow] = {}
        self.properties: dict[str, Properties] = {}  # node id -> its suite properties
        self.interrupted = False
        self.watchdog_dir: Path | None = None  # made when xdist starts its first worker
        self.collected: Counter[str] = Counter()  # tier -> checks collected to run

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: WorkerNode) -> None:
        """xdist is starting a worker: tell it where its native watchdog writes."""
        if self.watchdog_dir is None:
            self.watchdog_dir = Path(tempfile.mkdtemp(prefix="specgate-watchdog-"))
        node.workerinput[WORKER_INPUT_KEY] = str(self.watchdog_dir)

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True  # the results then cover only the checks that completed

    def _collected(self, nodeids: list[str]) -> None:
        """The checks each tier was to run, so an interrupted run can say which tiers only
        partly ran (every xdist worker reports the same collection; the first is kept)."""
        if not self.collected:
            tiers = self.known_tiers()
            self.collected = Counter(t for t in map(tier_of, nodeids) if t in tiers)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # in-process (under xdist the controller collects nothing)
            self._collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self._collected(list(ids))

    def _crashed(self, report: pytest.TestReport) -> None:
        """xdist's report for a check whose worker died (its own phase name is not one of
        pytest's): a row from the properties the check's set-up sent, and why it died."""
        if tier_of(report.nodeid) not in self.known_tiers():
            return
        props = self.properties.get(report.nodeid, [("specgate_tier", tier_of(report.nodeid))])
        worker = getattr(report, "node", None)
        worker_id = getattr(getattr(worker, "gateway", None), "id", "?")
        seconds = case_timeout(self.config)
        message = crash_message(self.watchdog_dir, worker_id, seconds, native_grace(seconds))
        self._store(report, props, "failed", message)

    @staticmethod
    def known_tiers() -> set[str]:
        from conformance.run.suite import suite_dir
        return {tier_of(p.name) for p in suite_dir().glob("test_*.py")}

    def _store(self, report: pytest.TestReport, props: Properties, outcome: str,
               message: str) -> None:
        previous = self.rows.get(report.nodeid)
        if previous is not None and previous.outcome == "failed":
            return  # a teardown after a failure must not hide the failure
        self.rows[report.nodeid] = check_row(report, props, outcome, message)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when not in ("setup", "call", "teardown"):
            if report.failed:
                self._crashed(report)
            return
        props: Properties = list(report.user_properties)
        if not any(name == "specgate_tier" for name, _ in props):
            return
        self.properties[report.nodeid] = props
        final = report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed)
        if final:
            self._store(report, props, _outcome(report), _message(report))
        progress = dict(props).get("specgate_progress")
        if isinstance(progress, (list, tuple)) and report.nodeid in self.rows:  # its last report
            self.rows[report.nodeid] = replace(self.rows[report.nodeid],
                                               progress=tuple(map(str, progress)))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.watchdog_dir is not None:
            shutil.rmtree(self.watchdog_dir, ignore_errors=True)
        results_path = self.config.getoption("--specgate-results")
        rows = list(self.rows.values())
        # an incomplete run is reported as such, not as vacuous; a plain pytest run that
        # collected no suite check (no results asked for) is no certification run at all
        vacuous = (None if self.interrupted or (not rows and not results_path)
                   else vacuous_reason(rows))
        if vacuous:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"specgate: vacuous run refused: {vacuous}", red=True)
        if results_path:
            Path(results_path).write_text(dump_results(self.results(rows, vacuous)))

    def results(self, rows: list[CheckRow], vacuous: str | None) -> RunResults:
        """The run's results: what ran it (the session's context) and its rows."""
        ctx = context(self.config)
        return RunResults(
            backend=BackendIdentity(ctx.backend.name, ctx.backend.version, ctx.backend_name,
                                    declared_version(ctx.backend)),
            capabilities=ctx.caps, spec=ctx.spec.name, profile=ctx.profile.name,
            checks=tuple(rows), unclaimed_reasons=unclaimed_reasons(ctx.backend),
            configurations=tuple(config_record(c) for c in ctx.spec.configs),
            precision=ctx.caps.precision, case_timeout=case_timeout(self.config),
            threads=tuple(sorted({r.threads for r in rows if r.threads is not None})),
            graphs=ctx.graph_executor, device=ctx.device, model=ctx.model,
            draft_model=ctx.draft_model or None,
            environment=run_environment(ctx.device, ctx.caps.precision),
            vacuous=vacuous, collected=dict(self.collected), interrupted=self.interrupted)
