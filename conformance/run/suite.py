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
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass(frozen=True)
class SuiteOptions:
    backend: str
    spec: str
    profile: str
    model: str
    draft_model: str | None = None
    graphs: str | None = None         # the backend's graph executor (None: eager)
    device: str = "cpu"               # where the backend runs (cpu, cuda, cuda:N)
    workers: int = 0                  # pytest-xdist workers; 0 runs in-process (where no
    #                                   native watchdog can end a check stuck in native code)
    stop_at_first_failure: bool = False
    case_timeout: float | None = None  # seconds per phase of a check (None: the profile's)
    only: tuple[str, ...] = ()         # node ids to run alone (``conformance.run.only``)
    keyword: str | None = None         # pytest's -k expression
    shard: str | None = None           # "I/N" (``conformance.run.shard``)
    durations: str | None = None       # the table the shards are balanced by (None: bundled)
    repro_dir: str | None = None       # the certificate directory: a failing check writes
    #                                   its repro file into its repro/


@dataclass
class SuiteRun:
    exit_code: int
    results: dict[str, object] | None   # the plugin's results file, if pytest got that far
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
    from conformance.run.only import only_modules

    where = only_modules(list(opts.only), suite_dir()) if opts.only else [str(suite_dir())]
    args = [*where, "-c", os.devnull, "--rootdir", str(suite_dir()),
            *(arg for plugin in SUITE_PLUGINS for arg in ("-p", plugin)),
            "-p", "no:cacheprovider", "-p", "no:terminal",
            "--specgate-backend", opts.backend, "--specgate-spec", opts.spec,
            "--specgate-profile", opts.profile, "--specgate-model", opts.model,
            "--specgate-results", str(results),
            # the plugin is imported before pytest starts, so pytest cannot rewrite its asserts
            "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "-W", "ignore::DeprecationWarning"]
    if opts.draft_model:
        args += ["--specgate-draft-model", opts.draft_model]
    if opts.graphs:
        args += ["--specgate-graphs", opts.graphs]
    if opts.device != "cpu":
        args += ["--specgate-device", opts.device]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    if opts.case_timeout is not None:
        args += ["--specgate-case-timeout", str(opts.case_timeout)]
    args += [arg for nodeid in opts.only for arg in ("--specgate-only", nodeid)]
    if opts.keyword:
        args += ["-k", opts.keyword]
    if opts.shard:
        args += ["--specgate-shard", opts.shard]
    if opts.durations:
        args += ["--specgate-durations", opts.durations]
    if opts.repro_dir:
        args += ["--specgate-repro-dir", opts.repro_dir]
    if opts.stop_at_first_failure:
        args.append("-x")
    if opts.workers >= 1:
        args += ["-n", str(opts.workers)]
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
    there (no progress is drawn). None: ``opts.backend`` is no source mutant."""
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS, run_patched

    mutant = SOURCE_MUTANTS.get(opts.backend.removeprefix("mutant:"))
    if mutant is None or not opts.backend.startswith("mutant:"):
        return None
    done = run_patched(mutant, suite_args(opts, results, junit))
    loaded = json.loads(results.read_text()) if results.exists() else None
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
    loaded = json.loads(results.read_text()) if results.exists() else None
    return SuiteRun(int(code), loaded, watch.interrupted, watch.problems)
