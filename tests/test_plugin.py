"""The pytest plugin: capability gating, "not claimed" reporting, the vacuous-run guard."""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from conformance.backends.refengine import RefEngineBackend
from conformance.backends.refengine.adapter import RefEngineHandle
from conformance.contract import Capabilities, OpenConfig
from conformance.plan.registry import BackendError, load_backend
from conformance.report.certificate import build_certificate
from conformance.report.markdown import render_markdown
from conformance.report.results_json import results_from_json

pytest_plugins = ["pytester"]


class ClaimsNothingUseful(RefEngineBackend):
    """Claims only ``draft_model``: nothing under the default spec, a real run under
    ``--specgate-spec draft-model``."""

    name = "claims-nothing"

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"draft_model"}))


class RunToCompletionOnly(RefEngineBackend):
    name = "run-to-completion"

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none"}))


class SaysWhatItBuilds(RunToCompletionOnly):
    """Writes a progress line (and a line that is not one) to stderr on every open, as the
    reference engine does when it compiles a graph key."""

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        print("specgate: compiled decode-b1-kv256 in 1.5 s", file=sys.stderr)
        print("some other noise", file=sys.stderr)
        return super().open(cfg)


def says_what_it_builds() -> SaysWhatItBuilds:
    return SaysWhatItBuilds()


def claims_nothing() -> ClaimsNothingUseful:
    return ClaimsNothingUseful()


def run_to_completion() -> RunToCompletionOnly:
    return RunToCompletionOnly()


SUITE = Path(__file__).resolve().parents[1] / "conformance" / "suites"


def plugin_args() -> list[str]:
    """Load the plugin explicitly only when no installed entry point does it already."""
    installed = any(ep.name == "specgate" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.run.plugin"]


def run_suite(pytester: pytest.Pytester, backend: str, model: Path, *extra: str
              ) -> tuple[pytest.RunResult, dict]:
    results = pytester.path / "results.json"
    res = pytester.runpytest_inprocess(
        str(SUITE), "-c", str(pytester.path / "none.ini"), "--rootdir", str(SUITE),
        "-p", "no:cacheprovider", *plugin_args(), "--specgate-backend", backend,
        "--specgate-model", str(model), "--specgate-results", str(results), *extra)
    return res, json.loads(results.read_text())


def test_unclaimed_everything_is_a_vacuous_failure(pytester: pytest.Pytester,
                                                    random_model_dir: Path) -> None:
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, "tests.test_plugin:claims_nothing", random_model_dir)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*vacuous run refused*"])
    assert results["vacuous"]
    assert results["checks"] and all(c["outcome"] == "not claimed" for c in results["checks"])


def test_only_draft_model_gets_a_real_run(pytester: pytest.Pytester) -> None:
    """The same backend under ``--spec draft-model``: its checks run and pass (not a
    vacuous run), on the bundled target, whose tokenizer and KV layout the draft shares."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, "tests.test_plugin:claims_nothing", Path("tiny-code"),
                             "--specgate-spec", "draft-model", "-k",
                             "test_greedy_matches_reference and batch-1")
    assert res.ret == pytest.ExitCode.OK, res.stdout.str()[-2000:]
    assert not results["vacuous"]
    passed = [c["nodeid"] for c in results["checks"] if c["outcome"] == "passed"]
    assert any("draft-n4" in n for n in passed) and any("draft-n6" in n for n in passed)


def test_gating_marks_unclaimed_checks(pytester: pytest.Pytester,
                                       random_model_dir: Path) -> None:
    """A backend without stepwise/abort/memory_view: those checks are 'not claimed', the rest
    run and pass, and the header names the backend."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, "tests.test_plugin:run_to_completion", random_model_dir,
                             "-k", "memory or abort or max_new_tokens")
    res.stdout.fnmatch_lines(["*specgate: backend tests.test_plugin:run_to_completion*"])
    outcomes = {c["nodeid"].split("::")[1]: c["outcome"] for c in results["checks"]}
    assert outcomes["test_abort[queued]"] == "not claimed"
    assert outcomes["test_invariants_under_pressure[plain-1]"] == "not claimed"
    assert outcomes["test_max_new_tokens[1]"] == "passed"
    assert res.ret == pytest.ExitCode.OK


def test_the_backends_progress_lines_reach_the_results_and_the_certificate(
        pytester: pytest.Pytester, random_model_dir: Path) -> None:
    """pytest captures what a check writes, so without the relay a key compiled during a run
    (minutes, the first time) would go unseen: each check's row carries the backend's progress
    lines (only those), and report.md lists them by check."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, "tests.test_plugin:says_what_it_builds",
                             random_model_dir, "-k", "test_max_new_tokens")
    assert res.ret == pytest.ExitCode.OK
    ran = [c for c in results["checks"] if c["outcome"] == "passed"]
    assert ran and all(c["progress"] and set(c["progress"])
                       == {"specgate: compiled decode-b1-kv256 in 1.5 s"} for c in ran)
    markdown = render_markdown(build_certificate(results_from_json(results, "results.json")))
    section = markdown.split("## Backend progress", 1)[1].split("\n## ", 1)[0]
    assert f"- specgate: compiled decode-b1-kv256 in 1.5 s (`{ran[0]['nodeid']}`)" in section
    assert "noise" not in section


def test_registry_errors_name_the_problem() -> None:
    with pytest.raises(BackendError, match="unknown backend 'zzz'"):
        load_backend("zzz")
    with pytest.raises(BackendError, match="has no 'nothing_here'"):
        load_backend("tests.test_plugin:nothing_here")
    with pytest.raises(BackendError, match="did not give a Backend"):
        load_backend("tests.test_plugin:SUITE")
    assert load_backend("refengine").name == "refengine"
