"""The hooks that run the suite, registered by the specgate plugin (``conformance.run.plugin``)
only in a session that runs it; this module imports torch and the engine.

They resolve the backend under test, gate every suite check on the capabilities the backend
declares (an undeclared one is reported as "not claimed", never as passed), refuse vacuous runs
(zero checks, or every check skipped), print a header naming backend, version and capabilities,
and write a machine-readable results file for ``specgate certify``. Under pytest-xdist,
per-check data travels in ``user_properties`` and only the controller writes results.

A check that raises or hangs fails alone: every phase of a check has a timeout
(``conformance.run.case_timeout``), and a worker stuck in native code is ended by the native
watchdog (``conformance.run.native_watchdog``); xdist reports that check as crashed, and its row
says why. The results also say what was certified: each configuration's parameters and the
precision the backend declares (``conformance.report.certified``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.contract import SpecConfig, unclaimed_under
from conformance.plan.specs import SpecChoice, config_id
from conformance.report.progress import backend_progress, tier_of
from conformance.repro.record import write_repro
from conformance.run.case_timeout import CaseDeadline, CaseTimeout
from conformance.run.collector import NOT_CLAIMED, ResultCollector
from conformance.run.context import SuiteContext, case_timeout, context
from conformance.run.interrupt_redelivery import keep_interrupts
from conformance.run.native_watchdog import WORKER_INPUT_KEY, NativeWatchdog, dump_path
from conformance.run.options import SELF_CHECK_MARK
from conformance.run.quick_exit import WorkerInterruptExit

LONG_TIER = "fuzz"


def pytest_configure(config: pytest.Config) -> None:
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


def pytest_sessionstart(session: pytest.Session) -> None:
    # after every plugin's pytest_configure: pytest's own unraisable-exception hook is in place
    # by now, and keep_interrupts passes everything but a swallowed Ctrl-C on to it
    keep_interrupts()


def pytest_report_header(config: pytest.Config) -> list[str]:
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
    spec_config = params.get("spec_config")
    if not isinstance(spec_config, SpecConfig):
        return ""
    try:
        reasons = unclaimed_under(ctx.backend, spec_config)
    except ValueError as err:
        raise pytest.UsageError(f"backend {ctx.backend_name!r}: {err}") from None
    return "; ".join(f"{flag} under {config_id(spec_config)} ({reasons[flag]})"
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
