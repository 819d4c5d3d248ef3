"""The results of a suite run: one row per suite check, collected on the xdist controller (or
the only process), the vacuous-run guard applied at the end of the session, and the results
file ``specgate certify`` turns into a certificate."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from conformance.contract import unclaimed_reasons
from conformance.contract.versions import declared_version
from conformance.report.certified import config_record
from conformance.report.environment import run_environment
from conformance.report.progress import tier_of
from conformance.report.verdict import vacuous_reason
from conformance.run.case_timeout import native_grace
from conformance.run.context import case_timeout, context
from conformance.run.native_watchdog import WORKER_INPUT_KEY, crash_message

NOT_CLAIMED = "not claimed"


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


class ResultCollector:
    """Collects one row per suite check (on the xdist controller, or the only process) and
    applies the vacuous-run guard at the end of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.rows: dict[str, dict[str, object]] = {}
        self.properties: dict[str, dict[str, object]] = {}  # node id -> its suite properties
        self.interrupted = False
        self.watchdog_dir: Path | None = None  # made when xdist starts its first worker
        self.collected: Counter[str] = Counter()  # tier -> checks collected to run

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: object) -> None:
        """xdist is starting a worker: tell it where its native watchdog writes."""
        if self.watchdog_dir is None:
            self.watchdog_dir = Path(tempfile.mkdtemp(prefix="specgate-watchdog-"))
        node.workerinput[WORKER_INPUT_KEY] = str(self.watchdog_dir)  # type: ignore[attr-defined]

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
        props = self.properties.get(report.nodeid, {"specgate_tier": tier_of(report.nodeid)})
        worker = getattr(report, "node", None)
        worker_id = getattr(getattr(worker, "gateway", None), "id", "?")
        seconds = case_timeout(self.config)
        message = crash_message(self.watchdog_dir, worker_id, seconds, native_grace(seconds))
        self._store(report, props, "failed", message)

    @staticmethod
    def known_tiers() -> set[str]:
        from conformance.run.suite import suite_dir
        return {tier_of(p.name) for p in suite_dir().glob("test_*.py")}

    def _store(self, report: pytest.TestReport, props: dict[str, object], outcome: str,
               message: str) -> None:
        previous = self.rows.get(report.nodeid)
        if previous is not None and previous["outcome"] == "failed":
            return  # a teardown after a failure must not hide the failure
        self.rows[report.nodeid] = {
            "nodeid": report.nodeid, "tier": props["specgate_tier"],
            "requires": props.get("specgate_requires", ""), "outcome": outcome,
            "duration": round(report.duration, 3), "message": message,
            "figures": {k: v for k, v in props.items() if not k.startswith("specgate_")}}
        if props.get("specgate_self_check"):
            self.rows[report.nodeid]["self_check"] = True
        if "specgate_threads" in props:
            self.rows[report.nodeid]["threads"] = props["specgate_threads"]
        if "specgate_repro" in props:
            self.rows[report.nodeid]["repro"] = props["specgate_repro"]
            self.rows[report.nodeid]["repro_reproduces"] = props["specgate_repro_reproduces"]
            if "specgate_repro_not_replayed" in props:
                self.rows[report.nodeid]["repro_not_replayed"] = props[
                    "specgate_repro_not_replayed"]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when not in ("setup", "call", "teardown"):
            if report.failed:
                self._crashed(report)
            return
        props = dict(report.user_properties)
        if "specgate_tier" not in props:
            return
        self.properties[report.nodeid] = props
        final = report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed)
        if final:
            self._store(report, props, _outcome(report), _message(report))
        if "specgate_progress" in props and report.nodeid in self.rows:  # on its last report
            self.rows[report.nodeid]["progress"] = list(props["specgate_progress"])  # type: ignore[call-overload]

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
            ctx = context(self.config)
            Path(results_path).write_text(json.dumps({
                "backend": {"name": ctx.backend.name, "version": ctx.backend.version,
                            "resolved_from": ctx.backend_name,
                            "contract_version": declared_version(ctx.backend)},
                "capabilities": ctx.caps.as_dict(), "spec": ctx.spec.name,
                "unclaimed_reasons": unclaimed_reasons(ctx.backend),
                "configurations": [config_record(c) for c in ctx.spec.configs],
                # Capabilities.precision, where the backend's adapter has it
                "precision": str(getattr(ctx.caps, "precision", "float32")),
                "case_timeout": case_timeout(self.config),
                "threads": sorted({int(r["threads"]) for r in rows if "threads" in r}),
                "profile": ctx.profile.name, "graphs": ctx.graph_executor, "device": ctx.device,
                "model": ctx.model,
                "draft_model": self.config.getoption("--specgate-draft-model") or None,
                "environment": run_environment(ctx.device, ctx.caps.precision),
                "vacuous": vacuous, "collected": dict(self.collected),
                "interrupted": self.interrupted, "checks": rows,
            }, indent=1))
