"""A backend that raises in one check and hangs in another fails exactly those two checks, each
with the backend call it was in, and the run still ends with a complete certificate. A hang
that never returns to Python ends its xdist worker (the native watchdog); xdist runs the rest
on a fresh worker, and the certificate lists that check as failed with the reason.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest

from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.cli import build_parser, main
from conformance.contract import Event, OpenConfig
from conformance.plan.run_plan import RunPlan
from conformance.report.certificate import Certificate, build_certificate
from conformance.report.results_json import read_results
from conformance.run.case_timeout import DEFAULT_SECONDS
from conformance.run.suite import SuiteOptions, suite_args
from refengine.graph.executors import EXECUTORS

REPO = Path(__file__).resolve().parents[1]
FAULTS_ENV = "SPECGATE_TEST_FAULTS"  # JSON {"raise"|"hang"|"native": node id}; env reaches
#                                      xdist workers too
CHECKS = [*(f"test_lifecycle.py::test_max_new_tokens[{n}]" for n in (1, 2, 3)),
          "test_lifecycle.py::test_stop_at_first_token"]
SELECT = "test_max_new_tokens or test_stop_at_first_token"


def _fault_here() -> str | None:
    """The fault planted in the check running now, if any (pytest names it in the env)."""
    running = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    faults = json.loads(os.environ.get(FAULTS_ENV, "{}"))
    return next((kind for kind, nodeid in faults.items() if nodeid == running), None)


class FaultyHandle(RefEngineHandle):
    """The reference engine, except on its second step in a check with a planted fault."""

    def __init__(self, handle: RefEngineHandle) -> None:
        super().__init__(handle.engine)
        self.steps = 0

    def step(self) -> list[Event]:
        self.steps += 1
        fault = _fault_here() if self.steps == 2 else None
        if fault == "raise":
            raise RuntimeError("injected failure")
        if fault == "hang":
            while True:  # a hang in Python: the case timeout's exception ends it
                time.sleep(0.05)
        if fault == "native":
            # Stuck where no signal reaches: SIGALRM blocked for this thread, as native code
            # that never returns to the interpreter would be.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(120)
        return super().step()


class FaultyBackend(RefEngineBackend):
    name = "faulty"

    def open(self, cfg: OpenConfig) -> FaultyHandle:
        return FaultyHandle(super().open(cfg))


def faulty() -> FaultyBackend:
    return FaultyBackend()


def certify_subset(tmp_path: Path, model: Path, workers: int,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[Certificate, float]:
    """The suite's selected checks against the faulty backend, as certify runs them."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # xdist workers import this module
    results = tmp_path / "results.json"
    opts = SuiteOptions(RunPlan("tests.test_isolation:faulty", ("none",), model=str(model),
                                workers=workers, case_timeout=1.0))
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*suite_args(opts, results, tmp_path / "junit.xml"), "-k", SELECT])
    return build_certificate(read_results(results)), time.monotonic() - started


def outcomes(cert: Certificate) -> dict[str, tuple[str, str]]:
    return {c.nodeid: (c.outcome, c.message) for c in cert.checks}


def test_a_raise_and_a_hang_fail_only_their_checks(tmp_path: Path, random_model_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"raise": CHECKS[1], "hang": CHECKS[2]}))
    cert, _ = certify_subset(tmp_path, random_model_dir, 0, monkeypatch)
    got = outcomes(cert)
    assert sorted(got) == sorted(CHECKS) and not cert.interrupted, got
    assert cert.status == "failed" and cert.case_timeout == 1.0
    assert {n for n, (o, _) in got.items() if o == "failed"} == {CHECKS[1], CHECKS[2]}, got
    assert got[CHECKS[0]][0] == got[CHECKS[3]][0] == "passed"
    raised, hung = got[CHECKS[1]][1], got[CHECKS[2]][1]
    assert "RuntimeError: injected failure" in raised and "during handle.step() call 2" in raised
    assert "case timeout: no return within 1 s" in hung and "during handle.step() call 2" in hung
    assert "live requests: [" in hung


@pytest.mark.slow
def test_a_native_hang_ends_the_worker_and_fails_only_its_check(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"raise": CHECKS[1], "native": CHECKS[2]}))
    cert, _ = certify_subset(tmp_path, random_model_dir, 1, monkeypatch)
    got = outcomes(cert)
    assert sorted(got) == sorted(CHECKS) and not cert.interrupted, got
    assert {n for n, (o, _) in got.items() if o == "failed"} == {CHECKS[1], CHECKS[2]}, got
    native = got[CHECKS[2]][1]
    assert "case timeout: no return within 1 s, nor 2 s later" in native, native
    assert "in step" in native and "worker gw0 was ended" in native, native
    assert "during handle.step() call 2" in got[CHECKS[1]][1]


def test_the_cli_states_the_default_timeouts() -> None:
    """The CLI spells the defaults out (building its parser must not import pytest)."""
    certify = build_parser()._subparsers._group_actions[0].choices["certify"]  # type: ignore[union-attr]
    help_text = " ".join(certify.format_help().split())
    stated = ", ".join(f"{p} {s:g}" for p, s in DEFAULT_SECONDS.items())
    assert f"default by profile: {stated}" in help_text
    assert EXECUTORS["compiled"].timeout_factor == 4
    assert "four times that with --graphs compiled" in help_text


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_a_bad_case_timeout_is_a_usage_error(value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certify", "--case-timeout", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specgate: error:") and "--case-timeout" in err[0]
