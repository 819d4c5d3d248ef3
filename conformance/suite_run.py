"""Run the conformance suite in-process under pytest, for ``certify`` and ``mutants``.

pytest's own terminal output is captured, not shown: the commands draw their own progress and
summary, and the captured text is kept for the cases where pytest itself could not run the
suite (a collection error, an internal error), so the user sees why.

A Ctrl-C inside pytest does not propagate: pytest catches it, finishes the session (results and
junit.xml are written for the checks that completed) and returns "interrupted" — the same exit
code it uses for collection errors. ``InterruptWatch`` tells the two apart, and ``run_suite``
reports a real interrupt as ``SuiteRun.interrupted``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest


@dataclass(frozen=True)
class SuiteOptions:
    backend: str
    spec: str
    profile: str
    model: str
    draft_model: str | None = None
    workers: int = 0                  # pytest-xdist workers; 0 or 1 runs in-process
    stop_at_first_failure: bool = False


@dataclass
class SuiteRun:
    exit_code: int
    results: dict[str, object] | None   # the plugin's results file, if pytest got that far
    interrupted: bool                   # a real Ctrl-C (SIGINT), not a collection error
    output: str                         # pytest's own terminal output


class InterruptWatch:
    """A pytest plugin that notes a keyboard interrupt (pytest swallows it)."""

    def __init__(self) -> None:
        self.interrupted = False

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True


def suite_dir() -> Path:
    import conformance.suites
    return Path(conformance.suites.__file__).resolve().parent


def plugin_args() -> list[str]:
    """Load the plugin explicitly only when no installed entry point does it already."""
    installed = any(ep.name == "specgate" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.plugin"]


def suite_args(opts: SuiteOptions, results: Path, junit: Path | None) -> list[str]:
    args = [str(suite_dir()), "-c", os.devnull, "--rootdir", str(suite_dir()),
            "-p", "no:cacheprovider", *plugin_args(),
            "--specgate-backend", opts.backend, "--specgate-spec", opts.spec,
            "--specgate-profile", opts.profile, "--specgate-model", opts.model,
            "--specgate-results", str(results), "-q", "--no-header", "--tb=short",
            # the plugin is imported before pytest starts, so pytest cannot rewrite its asserts
            "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "-W", "ignore::DeprecationWarning"]
    if opts.draft_model:
        args += ["--specgate-draft-model", opts.draft_model]
    if junit is not None:
        args += ["--junitxml", str(junit)]
    if opts.stop_at_first_failure:
        args.append("-x")
    if opts.workers > 1:
        args += ["-n", str(opts.workers)]
    return args


def run_suite(opts: SuiteOptions, results: Path, junit: Path | None = None,
              plugins: tuple[object, ...] = ()) -> SuiteRun:
    watch = InterruptWatch()
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = pytest.main(suite_args(opts, results, junit), plugins=[watch, *plugins])
    loaded = json.loads(results.read_text()) if results.exists() else None
    return SuiteRun(int(code), loaded, watch.interrupted, captured.getvalue())
