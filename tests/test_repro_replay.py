"""A failing check's repro file, end to end: certify against a bug-zoo mutant leaves one, the
certificate shows the command that replays it, ``specgate repro`` exits 1 on the mutant and 0 on
the reference engine, and the pytest module ``--emit-pytest`` writes does the same under plain
pytest (through the plugin's ``specgate_backend`` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.contract import OpenConfig, SamplingParams
from conformance.plan.registry import load_backend
from conformance.repro.replay import replay
from conformance.repro.scenario import (
    Abort,
    OpenSession,
    Run,
    Scenario,
    Step,
    Submit,
    load,
    save,
)
from tests.failing_certify import certify_failing, failed_row

MUTANT = "mutant:max_new_tokens_off_by_one"
CHECK = "test_lifecycle.py::test_max_new_tokens[2]"


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return certify_failing(tmp_path_factory.mktemp("cert") / "report", MUTANT, "none", CHECK)


def test_a_failing_check_leaves_a_repro_and_the_command(certified: Path) -> None:
    row = failed_row(certified, CHECK)
    repro = certified / str(row["repro"])
    assert repro.parent.name == "repro" and repro.is_file()
    scenario = load(repro)
    assert scenario.check == CHECK and scenario.backend == MUTANT and scenario.failure
    assert f"specgate repro {repro} --backend {MUTANT}" in (certified / "report.md").read_text()


def test_repro_exits_1_on_the_mutant_and_0_on_refengine(
        certified: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (repro,) = (certified / "repro").glob("*.json")
    assert main(["repro", str(repro)]) == 1  # the recorded backend by default
    out = capsys.readouterr().out
    assert "first divergence" in out and "expected:" in out and "came:" in out, out
    assert main(["repro", str(repro), "--backend", "refengine"]) == 0
    assert "clean" in capsys.readouterr().out


def test_the_emitted_module_does_the_same_under_pytest(certified: Path, tmp_path: Path) -> None:
    (repro,) = (certified / "repro").glob("*.json")
    module = tmp_path / "test_regression.py"
    assert main(["repro", str(repro), "--emit-pytest", str(module)]) == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    outcomes = {}
    for backend in (MUTANT, "refengine"):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "-p", "no:randomly", str(module), "--specgate-backend", backend],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
        outcomes[backend] = (done.returncode, done.stdout)
    code, out = outcomes[MUTANT]
    assert code == 1 and "first divergence" in out and "got more" in out, out
    assert f"on backend '{MUTANT}': " in out, out
    assert outcomes["refengine"][0] == 0, outcomes["refengine"][1]
    # no backend named: it refuses, naming the one it was recorded on, rather than passing on
    # the reference engine with the bug present
    bare = {k: v for k, v in env.items() if k != "SPECGATE_BACKEND"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "no:xdist", "-p", "no:randomly", str(module)], cwd=tmp_path, env=bare,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stdout
    assert "no backend to replay on: run this repro with --specgate-backend NAME" in done.stdout
    assert f"it was recorded on '{MUTANT}'" in done.stdout, done.stdout


def test_replay_names_the_step_request_and_memory_of_a_leak() -> None:
    """A scenario written by hand (one aborted request beside a finishing one) against the
    mutant that leaks an aborted request's row: the divergence is the idle check's, with the
    memory view before and after."""
    run = Run(OpenConfig(model="tiny-code", page_size=4, kv_pool_tokens=256),
              (Submit("a", (5, 6, 7, 8), SamplingParams(max_new_tokens=3, ignore_eos=True)),
               Submit("b", (9, 10, 11), SamplingParams(max_new_tokens=9, ignore_eos=True)),
               Step(2), Abort("b")))
    scenario = Scenario((run,))
    assert replay(scenario, load_backend("refengine")) is None
    found = replay(scenario, load_backend("mutant:abort_leaks_row"))
    assert found is not None and "M4 idle" in found.came and "rows" in found.came
    assert found.memory_before and found.memory_after and found.step >= 3
    assert found.action == "run to completion" and found.action_index == len(run.actions)


def test_a_backend_lacking_a_capability_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = Run(OpenConfig(model="tiny-code"), (OpenSession("s"), Step()))
    path = tmp_path / "sessions.json"
    save(Scenario((run,)), path)
    assert main(["repro", str(path), "--backend", "ctranslate2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not claim" in err[0] and "sessions" in err[0], err


def test_an_abort_nobody_asked_for_diverges() -> None:
    """A scenario without an abort, on the mutant that gives up a retracted session turn: the
    turn's finish 'abort' is a divergence (the driver's check), not a rolled-back turn."""
    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, ignore_eos=True)

    # forced retraction takes the second of the two decoding requests: the session's turn
    run = Run(OpenConfig(model="tiny-code", retract_every=3),
              (OpenSession("s"), Submit("t0", (5, 6, 7, 8), greedy(2), "s"), Step(3),
               Submit("other", (12, 13, 14, 15), greedy(8)),
               Submit("t1", (9, 10, 11), greedy(8), "s")))
    scenario = Scenario((run,))
    assert replay(scenario, load_backend("refengine")) is None
    found = replay(scenario, load_backend("mutant:aborts_retracted_session_turns"))
    assert found is not None and found.rid is None and found.expected == (
        "the suite's invariants hold"), found
    assert "request 't1' finished 'abort'" in found.came and "never aborted it" in found.came
