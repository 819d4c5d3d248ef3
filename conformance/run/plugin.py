"""The specgate pytest plugin (entry point ``pytest11: specgate``).

It adds the ``--specgate-*`` options, resolves the backend under test, gates every suite check
on the capabilities the backend declares (an undeclared one is reported as "not claimed", never
as passed), refuses vacuous runs (zero checks, or every check skipped), prints a header naming
backend, version and capabilities, and writes a machine-readable results file for
``specgate certify``. Works under pytest-xdist: per-check data travels in ``user_properties``
and only the controller writes results.

A check that raises or hangs fails alone: every phase of a check has a timeout
(``conformance.run.case_timeout``), and a worker stuck in native code is ended by the native
watchdog (``conformance.run.native_watchdog``); xdist reports that check as crashed, and its row
says why. The results also say what was certified: each configuration's parameters and the
precision the backend declares (``conformance.report.certified``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from conformance.checks.oracle import ReferenceOracle
from conformance.contract import (
    Backend,
    Capabilities,
    OpenConfig,
    SpecConfig,
    unclaimed_reasons,
    unclaimed_under,
)
from conformance.contract.versions import declared_version
from conformance.report.certified import config_record
from conformance.report.environment import run_environment
from conformance.report.progress import backend_progress, tier_of
from conformance.report.verdict import SELF_CHECK_MARK, vacuous_reason
from conformance.repro.record import RecordedRuns, write_repro
from conformance.run.case_timeout import (
    CaseDeadline,
    CaseTimeout,
    default_seconds,
    native_grace,
)
from conformance.run.device import device_problem
from conformance.run.interrupt_redelivery import keep_interrupts
from conformance.run.native_watchdog import (
    WORKER_INPUT_KEY,
    NativeWatchdog,
    crash_message,
    dump_path,
)
from conformance.run.options import add_suite_options
from conformance.run.profiles import PROFILES, Profile
from conformance.run.prompts import PromptCase, load_prompt_set
from conformance.run.quick_exit import WorkerInterruptExit
from conformance.run.registry import BackendError, load_backend
from conformance.run.specs import SpecChoice, config_id, resolve_specs

NOT_CLAIMED = "not claimed"
LONG_TIER = "fuzz"
DEFAULT_BACKEND = "refengine"


@dataclass
class SuiteContext:
    """What every check needs: the backend, its claims, the spec, the profile and the oracle."""

    backend_name: str
    backend: Backend
    caps: Capabilities
    spec: SpecChoice
    profile: Profile
    model: str = "tiny-code"
    graph_executor: str | None = None  # --specgate-graphs
    device: str = "cpu"  # --specgate-device
    _oracle: ReferenceOracle | None = field(default=None, repr=False)
    _check: pytest.Item | None = field(default=None, repr=False)  # the suite check running now
    recorded: RecordedRuns = field(default_factory=RecordedRuns)  # its drivers, for a repro

    @property
    def prompts(self) -> tuple[PromptCase, ...]:
        return load_prompt_set(self.profile.prompt_set, self.model)

    def open_config(self, spec: SpecConfig | None, **limits: int) -> OpenConfig:
        """What every check opens the backend with: the model, ``spec``, the run's graph
        executor and device, and the check's own limits."""
        return replace(OpenConfig(model=self.model, spec=spec, graph_executor=self.graph_executor,
                                  device=self.device), **limits)

    @property
    def oracle(self) -> ReferenceOracle:
        if self._oracle is None:
            self._oracle = ReferenceOracle(self.model)
        return self._oracle

    def extend_property(self, name: str, entries: list[str]) -> None:
        """Add ``entries`` to the list property ``name`` of the running check (what pytest's
        ``record_property`` fixture writes), so helpers shared by the tiers record figures
        without every check handing the fixture down; calls within one check add up."""
        assert self._check is not None, "extend_property: no suite check is running"
        props = self._check.user_properties
        for i, (key, value) in enumerate(props):
            if key == name:
                props[i] = (name, [*value, *entries])
                return
        props.append((name, list(entries)))


def pytest_addoption(parser: pytest.Parser) -> None:
    add_suite_options(parser)


def _backend_name(config: pytest.Config) -> str:
    return (config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
            or DEFAULT_BACKEND)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "specgate_tier(name): the suite tier a check belongs to")
    config.addinivalue_line("markers", "specgate_requires(*capabilities): capabilities the "
                            "backend must claim (flags, or 'algorithm:<name>')")
    config.addinivalue_line("markers", "slow: long-running check")
    config.addinivalue_line("markers", f"{SELF_CHECK_MARK}: a check of the suite itself (its "
                            "power, its derivations) that exercises no part of the backend: "
                            "reported apart, never counted as the backend's pass")
    seconds = case_timeout(config)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # xdist workers forward their reports instead
        config.pluginmanager.register(WorkerInterruptExit(), "specgate-worker-exit")
        watchdog_dir = workerinput.get(WORKER_INPUT_KEY)
        watchdog = (NativeWatchdog(dump_path(Path(watchdog_dir), workerinput["workerid"]))
                    if watchdog_dir and seconds > 0 else None)
        config.pluginmanager.register(CaseDeadline(seconds, watchdog), "specgate-timeout")
    else:
        config.pluginmanager.register(ResultCollector(config), "specgate-results")
        # in-process runs: no native watchdog, which would end the whole run
        config.pluginmanager.register(CaseDeadline(seconds), "specgate-timeout")


def case_timeout(config: pytest.Config) -> float:
    chosen = config.getoption("--specgate-case-timeout")
    if chosen is not None:
        return float(chosen)
    return default_seconds(config.getoption("--specgate-profile"),
                           config.getoption("--specgate-graphs"))


def context(config: pytest.Config) -> SuiteContext:
    ctx = getattr(config, "_specgate_ctx", None)
    if ctx is None:
        name = _backend_name(config)
        try:
            backend = load_backend(name)
            spec = resolve_specs(config.getoption("--specgate-spec"))[0]
            draft = config.getoption("--specgate-draft-model")
            if draft:
                spec = spec.with_draft_model(draft)
        except (BackendError, ValueError) as err:
            raise pytest.UsageError(str(err)) from None
        caps = backend.capabilities()
        graphs = config.getoption("--specgate-graphs")
        if graphs and not caps.graph_runner:
            raise pytest.UsageError(f"--graphs: backend {name!r} does not claim graph_runner")
        device = config.getoption("--specgate-device")
        problem = device_problem(device, graphs)
        if problem:
            raise pytest.UsageError(problem)
        ctx = SuiteContext(name, backend, caps, spec,
                           PROFILES[config.getoption("--specgate-profile")],
                           config.getoption("--specgate-model"), graphs, device)
        config._specgate_ctx = ctx  # type: ignore[attr-defined]
    return ctx


def pytest_sessionstart(session: pytest.Session) -> None:
    # after every plugin's pytest_configure: pytest's own unraisable-exception hook is in place
    # by now, and keep_interrupts passes everything but a swallowed Ctrl-C on to it
    keep_interrupts()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not (config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
            or config.getoption("--specgate-results")):
        return None
    ctx = context(config)
    claimed = ", ".join(f"{k}={v}" for k, v in ctx.caps.as_dict().items())
    return [f"specgate: backend {ctx.backend_name} ({ctx.backend.name} {ctx.backend.version}); "
            f"spec {ctx.spec.name}; profile {ctx.profile.name}; graphs "
            f"{ctx.graph_executor or 'off'}; device {ctx.device}",
            f"specgate: capabilities: {claimed}"]


def _requirements(item: pytest.Item, spec: SpecChoice) -> list[str]:
    needs = ([f"algorithm:{spec.algorithm}"] + (["tree"] if spec.needs_tree else [])
             + (["overlap"] if spec.needs_overlap else []))
    for mark in item.iter_markers("specgate_requires"):
        needs.extend(mark.args)
    return needs


def _unclaimed_here(ctx: SuiteContext, item: pytest.Item, needs: list[str]) -> str:
    """What the check needs that the backend claims, but not under the item's configuration
    (``unclaimed_under``), said as ``flag under <config> (reason)``; "" if nothing."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    spec = params.get("spec_config")
    if not isinstance(spec, SpecConfig):
        return ""
    try:
        reasons = unclaimed_under(ctx.backend, spec)
    except ValueError as err:
        raise pytest.UsageError(f"backend {ctx.backend_name!r}: {err}") from None
    return "; ".join(f"{flag} under {config_id(spec)} ({reasons[flag]})"
                     for flag in dict.fromkeys(needs) if flag in reasons)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("specgate_tier"):
        ctx = context(item.config)
        ctx._check = item
        ctx.recorded.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    """Each suite check's row says how many intra-op threads torch ran it with (set by the
    ``sg`` fixture, in whichever process ran it): the certificate reports those, not the
    controller's."""
    if item.get_closest_marker("specgate_tier"):
        item.user_properties.append(("specgate_threads", torch.get_num_threads()))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A suite check that failed leaves its scenario (``conformance.repro.record``); the
    report's properties say where, so the row in the results (on the xdist controller too)
    can show the command that replays it. A check's last report also carries the backend's
    progress lines (``backend_progress``), which capture would otherwise swallow."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "teardown" and item.get_closest_marker("specgate_tier"):
        # what the backend said of its own work, from every phase's captured stderr
        progress = backend_progress(report.capstderr)
        if progress:
            report.user_properties.append(("specgate_progress", progress))
    where = item.config.getoption("--specgate-repro-dir")
    if (not report.failed or report.when == "teardown" or where is None
            or not item.get_closest_marker("specgate_tier")):
        return
    if call.excinfo is not None and call.excinfo.errisinstance(KeyboardInterrupt):
        return  # the run is stopping: no file, no replay
    ctx = context(item.config)
    crash = getattr(report.longrepr, "reprcrash", None)
    failure = crash.message if crash is not None else str(report.longrepr)[-800:]
    timed_out = call.excinfo is not None and call.excinfo.errisinstance(CaseTimeout)
    report.user_properties.extend(write_repro(
        ctx.recorded, Path(where), report.nodeid, failure[:2000], ctx.backend_name,
        ctx.backend, replay_it=not timed_out).items())


@pytest.fixture
def specgate_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend ``--specgate-backend`` (or $SPECGATE_BACKEND) names: what a regression repro
    module (``specgate repro --emit-pytest``) replays its scenario on. There is no default: a
    repro run on the reference engine by accident passes while the bug it holds is present,
    so without a name the test fails, saying which backend recorded it."""
    name = request.config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
    if not name:
        recorded = getattr(request.module, "RECORDED_ON", None)
        pytest.fail("no backend to replay on: run this repro with --specgate-backend NAME (or "
                    "SPECGATE_BACKEND=NAME)"
                    + (f"; it was recorded on {recorded!r}" if recorded else ""), pytrace=False)
    try:
        backend = load_backend(name)
    except BackendError as err:
        raise pytest.UsageError(str(err)) from None
    request.node.user_properties.append(("specgate_replayed_on", name))
    print(f"specgate: replaying on backend {name!r}")  # shown with -s, -rA, and on failure
    return backend


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite_items = [i for i in items if i.get_closest_marker("specgate_tier")]
    if not suite_items:
        return
    ctx = context(config)
    for item in suite_items:
        tier = item.get_closest_marker("specgate_tier").args[0]
        needs = _requirements(item, ctx.spec)
        missing = list(dict.fromkeys(n for n in needs if not ctx.caps.claims(n)))
        item.user_properties.append(("specgate_tier", tier))
        item.user_properties.append(("specgate_requires", ",".join(needs)))
        if item.get_closest_marker(SELF_CHECK_MARK):
            item.user_properties.append(("specgate_self_check", True))
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"{NOT_CLAIMED}: {', '.join(missing)}"))
        elif (excepted := _unclaimed_here(ctx, item, needs)):
            item.add_marker(pytest.mark.skip(reason=f"{NOT_CLAIMED}: {excepted}"))
    # The fuzz tier is one long check. In-process it goes last: it shrinks what it finds, the
    # longest way to fail, and a run stopping at its first failure (``specgate mutants``) then
    # fails by a hand-written check where one catches the bug. Under xdist it goes first, so
    # one worker runs it while the others take the rest, instead of it running alone at the end.
    in_worker = getattr(config, "workerinput", None) is not None
    items.sort(key=lambda i: (tier_of(i.nodeid) == LONG_TIER) != in_worker)


@pytest.fixture(scope="session")
def sg(request: pytest.FixtureRequest) -> SuiteContext:
    """The suite context: backend under test, its capabilities, spec, profile, oracle.

    The suite's tiny models are bound by per-op overhead, and torch's intra-op threads stall
    badly when pytest-xdist workers share the cores: each suite process uses one thread.
    """
    torch.set_num_threads(1)
    return context(request.config)


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
