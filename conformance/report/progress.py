"""What a long run shows while it works, drawn with ``rich`` on stderr (stdout stays for results).

Two shapes: ``Steps`` for commands that work through a list of items (golden configurations,
mutants, bench lanes), and ``TierProgress``, a pytest plugin that shows the conformance suite's
progress per tier (checks done of total, failures, elapsed time) while ``specgate certify`` runs.

On a terminal the bars redraw in place. Anywhere else (a CI log, a pipe) nothing redraws: each
item or tier is announced and finished with one plain line, so a log still shows that the run
is alive and how long each part took. A backend's own progress lines (``BACKEND_PROGRESS``:
a key it compiles, once per machine) are shown as each check ends.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from types import TracebackType

import pytest
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

# A backend's own progress lines (the reference engine's "specgate: compiled <key> in 21.3 s"):
# the stderr lines it writes during a check that start with this. pytest captures a check's
# output (in every process, xdist workers too), so the plugin carries these lines in the
# check's report to the console and into the certificate.
BACKEND_PROGRESS = "specgate: "


def backend_progress(captured: str) -> list[str]:
    """The backend's progress lines in a check's captured stderr."""
    return [line.strip() for line in captured.splitlines()
            if line.startswith(BACKEND_PROGRESS)]


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _bars(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=console,
                    disable=not console.is_terminal, redirect_stdout=False,
                    redirect_stderr=False)


def seconds(elapsed: float) -> str:
    return f"{elapsed:.1f} s" if elapsed < 120 else f"{int(elapsed // 60)} min {elapsed % 60:.0f} s"


class Steps:
    """Progress through ``total`` items, one at a time: ``start(label)``, then ``done(result)``.

    Every finished item leaves a line ``[i/n] label: result (time)``; on a terminal a bar with
    the current item and the elapsed time sits below those lines."""

    def __init__(self, title: str, total: int, console: Console | None = None) -> None:
        self.console = console or stderr_console()
        self.total = total
        self.index = 0
        self.label = ""
        self.started = time.monotonic()
        self.bars = _bars(self.console)
        self.task = self.bars.add_task(title, total=total, note="")

    def __enter__(self) -> Steps:
        self.bars.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.bars.stop()

    def start(self, label: str) -> None:
        self.index += 1
        self.label = label
        self.started = time.monotonic()
        self.bars.update(self.task, note=label)
        if not self.console.is_terminal:
            self.console.print(f"[{self.index}/{self.total}] {label} ...")

    def note(self, text: str) -> None:
        """A line about the current item (e.g. one measured batch size of a bench lane)."""
        self.console.print(f"    {text}")

    def done(self, result: str) -> None:
        elapsed = seconds(time.monotonic() - self.started)
        self.console.print(f"[{self.index}/{self.total}] {self.label}: {result} ({elapsed})")
        self.bars.advance(self.task)


def tier_of(nodeid: str) -> str:
    """The suite keeps one tier per file, ``test_<tier>.py``; the controller of an xdist run
    sees node ids only, so totals per tier come from the file name (a test checks that every
    check's tier marker agrees with its file)."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return name.removeprefix("test_").removesuffix(".py")


class TierProgress:
    """A pytest plugin: per-tier bars while the suite runs (controller side under xdist)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or stderr_console()
        self.bars = _bars(self.console)
        self.totals: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.failed: defaultdict[str, set[str]] = defaultdict(set)  # tier -> failed node ids
        self.tasks: dict[str, TaskID] = {}
        self.started = time.monotonic()

    def _plan(self, nodeids: list[str]) -> None:
        if self.tasks:  # every xdist worker reports the same collection
            return
        self.totals.update(tier_of(n) for n in nodeids)
        for tier in sorted(self.totals):
            self.tasks[tier] = self.bars.add_task(tier, total=self.totals[tier], note="")
        self.bars.start()
        if not self.console.is_terminal:
            self.console.print(f"{sum(self.totals.values())} checks in {len(self.totals)} "
                               f"tiers: " + ", ".join(f"{t} {n}" for t, n in
                                                      sorted(self.totals.items())))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # in-process run (under xdist the controller collects nothing)
            self._plan([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self._plan(list(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = tier_of(report.nodeid)
        if tier not in self.tasks:
            return
        if report.failed:
            self.failed[tier].add(report.nodeid)
        if report.when in ("setup", "call"):
            return  # a check ends at its teardown, or at xdist's report that its worker died
        for line in dict(report.user_properties).get("specgate_progress", []):
            self.console.print(f"    {line}", markup=False)
        self.done[tier] += 1
        failed = len(self.failed[tier])
        self.bars.update(self.tasks[tier], advance=1,
                         note=f"{failed} failed" if failed else "")
        if self.done[tier] == self.totals[tier] and not self.console.is_terminal:
            self.console.print(f"  {tier}: {self.done[tier]}/{self.totals[tier]} checks"
                               + (f", {failed} failed" if failed else "")
                               + f" ({seconds(time.monotonic() - self.started)} into the run)")

    def pytest_sessionfinish(self) -> None:
        self.bars.stop()
