"""Run the conformance suite in-process under pytest, for ``certify`` and ``mutants``.

The suite runs with exactly the plugins it needs (specgate's own, pytest-xdist for ``-n``,
junitxml): plugin auto-loading is off, so whatever else is installed (a test-order randomiser,
a timeout plugin, syrupy) cannot change a certification run. pytest's terminal reporter is off
too: the commands draw their own progress and summary. What pytest would have said about a
suite it could not run (a collection error, an internal error) is kept in ``SuiteRun.problems``
so the user still sees why.

A Ctrl-C inside pytest does not propagate: pytest catches it, finishes the session (results and
junit.xml are written for the checks that completed) and returns "interrupted", the same exit
code it uses for collection errors. ``SuiteWatch`` tells the two apart, and ``run_suite``
reports a real interrupt as ``SuiteRun.interrupted``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conformance.plan.run_plan import RunPlan
from conformance.report.results import RunResults
from conformance.report.results_json import read_results


@dataclass(frozen=True)
class SuiteOptions:
    """One suite run: its plan (one spec, validated where it was built) and what only this
    process's session needs."""

    plan: RunPlan
    stop_at_first_failure: bool = False
    repro_dir: str | None = None       # the certificate directory: a failing check writes
    #                                    its repro file into its repro/


@dataclass
class SuiteRun:
    exit_code: int
    results: RunResults | None   # the plugin's results file, if pytest got that far
    interrupted: bool                   # a real Ctrl-C (SIGINT), not a collection error
    problems: list[str] = field(default_factory=list)  # why pytest could not run the suite


class SuiteWatch:
    """A pytest plugin that notes a keyboard interrupt (pytest swallows it) and the errors the
    (disabled) terminal reporter would have shown."""

    def __init__(self) -> None:
        self.interrupted = False
        self.problems: list[str] = []

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.problems.append(f"collecting {report.nodeid or 'the suite'}: "
                                 f"{report.longreprtext.strip()}")

    def pytest_internalerror(self, excrepr: object) -> None:
        self.problems.append(f"pytest internal error: {excrepr}")


def suite_dir() -> Path:
    """The suite's check modules, found beside this package (imported only by pytest)."""
    return Path(__file__).resolve().parents[1] / "suites"


# The plugins a suite run loads, and nothing else: auto-loading is switched off.
SUITE_PLUGINS = ("conformance.run.plugin", "conformance.run.only", "conformance.run.shard",
                 "xdist.plugin")


def suite_args(opts: SuiteOptions, results: Path, junit: Path | None) -> list[str]:
    """pytest's arguments for the run; its plan is written beside ``results``
    (``<results>.plan.json``) and handed over whole as ``--specgate-plan``."""
    from conformance.run.only import only_modules

    plan = opts.plan
    plan_file = results.with_suffix(".plan.json")
    plan.save(plan_file)
    where = only_modules(list(plan.only), suite_dir()) if plan.only else [str(suite_dir())]
    args = [*where, "-c", os.devnull, "--rootdir", str(suite_dir()),
            *(arg for plugin in SUITE_PLUGINS for arg in ("-p", plugin)),
            "-p", "no:cacheprovider", "-p", "no:terminal",
            "--specgate-plan", str(plan_file), "--specgate-results", str(results),
            # the plugin is imported before pytest starts, so pytest cannot rewrite its asserts
            "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "-W", "ignore::DeprecationWarning"]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    # selection, shards and workers are pytest's and its plugins' own options
    args += [arg for nodeid in plan.only for arg in ("--specgate-only", nodeid)]
    if plan.keyword:
        args += ["-k", plan.keyword]
    if plan.shard:
        args += ["--specgate-shard", plan.shard]
    if plan.durations:
        args += ["--specgate-durations", plan.durations]
    if opts.repro_dir:
        args += ["--specgate-repro-dir", opts.repro_dir]
    if opts.stop_at_first_failure:
        args.append("-x")
    if plan.workers >= 1:
        args += ["-n", str(plan.workers)]
    return args


@contextlib.contextmanager
def _no_plugin_autoload() -> Iterator[None]:
    """pytest (and the xdist workers it starts, which inherit the environment) load only the
    plugins named with -p."""
    before = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
        else:
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = before


def _run_source_mutant(opts: SuiteOptions, results: Path, junit: Path | None) -> SuiteRun | None:
    """A source-patch mutant's suite runs in a subprocess that imports its patched
    ``refengine`` (``conformance.backends.mutants.source_patches``); ``plugins`` cannot follow it
    there (no progress is drawn). None: the plan's backend is no source mutant."""
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS, run_patched

    backend = opts.plan.backend
    mutant = SOURCE_MUTANTS.get(backend.removeprefix("mutant:"))
    if mutant is None or not backend.startswith("mutant:"):
        return None
    done = run_patched(mutant, suite_args(opts, results, junit))
    loaded = read_results(results) if results.exists() else None
    problems = [] if loaded is not None else [(done.stderr or done.stdout).strip()[-2000:]]
    return SuiteRun(done.returncode, loaded, False, problems)


def run_suite(opts: SuiteOptions, results: Path, junit: Path | None = None,
              plugins: tuple[object, ...] = ()) -> SuiteRun:
    patched = _run_source_mutant(opts, results, junit)
    if patched is not None:
        return patched
    watch = SuiteWatch()
    with _no_plugin_autoload(), contextlib.redirect_stdout(io.StringIO()):
        code = pytest.main(suite_args(opts, results, junit), plugins=[watch, *plugins])
    loaded = read_results(results) if results.exists() else None
    return SuiteRun(int(code), loaded, watch.interrupted, watch.problems)
