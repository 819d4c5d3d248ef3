"""A golden-tier failure replays: its repro file records the accept lengths the check compared
exactly (format version 2), so ``specgate repro`` exits 1 on the mutant that failed (a lossless
draft regression: the outputs alone replay clean) and 0 on the reference engine; and the
replay's acceptance check itself, on a scenario written here."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.contract import OpenConfig, SamplingParams
from conformance.plan.prompts import load_prompt_set
from conformance.plan.registry import load_backend
from conformance.plan.specs import SPECS
from conformance.repro.command import with_spec
from conformance.repro.record import RecordedRuns
from conformance.repro.replay import replay
from conformance.repro.requirements import requirements
from conformance.repro.scenario import Action, Run, Scenario, Step, Submit, load
from refengine import Engine, EngineConfig
from tests.failing_certify import certify_failing, failed_row

MUTANT = "mutant:draft_after_retract_from_prompt_feature"
CHECK = "test_golden.py::test_retraction_acceptance_matches_golden[chain-s3-n4]"
CHAIN = SPECS["eagle"].configs[0]
PROMPT = tuple(load_prompt_set("default")[0].ids)
TOKENS = 16


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return certify_failing(tmp_path_factory.mktemp("cert") / "report", MUTANT, "eagle", CHECK)


def test_the_golden_failure_leaves_a_repro_that_reproduces(certified: Path) -> None:
    row = failed_row(certified, CHECK)
    repro = certified / str(row["repro"])
    assert json.loads(repro.read_text())["specgate_repro"] == 2
    (run,) = load(repro).runs
    assert run.config.retract_every and any(
        isinstance(a, Submit) and a.accept_lens for a in run.actions)


def test_repro_exits_1_on_the_mutant_and_0_on_refengine(
        certified: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (repro,) = (certified / "repro").glob("*.json")
    assert main(["repro", str(repro)]) == 1  # the recorded backend by default
    out = capsys.readouterr().out
    assert "first divergence" in out and "accept lengths" in out and "verify step" in out, out
    assert main(["repro", str(repro), "--backend", "refengine"]) == 0
    assert "clean" in capsys.readouterr().out


def _accept_lens() -> tuple[int, ...]:
    """What the reference engine accepts on PROMPT alone (its first token is prefill's)."""
    engine = Engine(EngineConfig(model="tiny-code", spec=CHAIN))
    (out,) = engine.generate([list(PROMPT)], SamplingParams(max_new_tokens=TOKENS,
                                                            temperature=0.0, ignore_eos=True))
    return tuple(out.accept_lens)


def _scenario(lens: tuple[int, ...]) -> Scenario:
    submit = Submit("r", PROMPT, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True),
                    accept_lens=lens)
    return Scenario((Run(OpenConfig(model="tiny-code", spec=CHAIN), (submit, Step(2))),))


def test_replay_holds_a_request_to_its_recorded_accept_lengths() -> None:
    lens = _accept_lens()
    backend = load_backend("refengine")
    assert replay(_scenario(lens[:3]), backend) is None
    worse = (lens[0] - 1 if lens[0] > 1 else 2, *lens[1:3])
    found = replay(_scenario(worse), backend)
    assert found is not None and found.rid == "r", found
    assert f"{lens[0]} tokens at verify step 0" in found.came, found.describe()
    assert "recorded accept lengths of its first 3 verify steps" in found.expected
    assert {"reference_draft", "acceptance_stats"} <= set(requirements(_scenario(lens).runs[0]))


def test_another_spec_drops_the_recorded_accept_lengths() -> None:
    scenario = _scenario((2, 1))
    assert with_spec(scenario, "eagle") == scenario  # its own configuration: kept
    other = with_spec(scenario, "eagle-tree")
    assert other.version == 1 and other.runs[0].config.spec == SPECS["eagle-tree"].configs[0]
    assert other.runs[0].actions[0] == replace(scenario.runs[0].actions[0], accept_lens=None)


@dataclass
class _Recorded:
    """What ``RecordedRuns`` reads of a driver: its run as recorded."""

    run: Run

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.run.actions

    def recorded(self) -> Run:
        return self.run


def test_a_scenario_carries_the_accept_lengths_its_check_wants() -> None:
    greedy, sampled = SamplingParams(max_new_tokens=8), SamplingParams(temperature=0.7)
    spec_run = Run(OpenConfig(model="tiny-code", spec=CHAIN),
                   (Submit("a", (5,), greedy), Submit("b", (6,), sampled),
                    Submit("c", (7,), greedy), Step(3)))
    plain_run = Run(OpenConfig(model="tiny-code"), (Submit("a", (5,), greedy),))
    runs = RecordedRuns([_Recorded(spec_run), _Recorded(plain_run)])  # type: ignore[list-item]
    runs.expect_acceptance({"a": [2, 1], "b": [3], "c": []})
    scenario = runs.scenario("check", "failed", "backend")
    assert scenario is not None and scenario.version == 2
    first, second = scenario.runs
    # a sampled request's acceptance is not determined, plain decoding has none
    assert [getattr(a, "accept_lens", None) for a in first.actions] == [(2, 1), None, None, None]
    assert second == plain_run
    runs.clear()
    assert runs.acceptance == {} and runs.drivers == []
