"""The repro file format: what is written reads back the same, and every bad file is refused
with one line naming where in it (the loader, and ``specgate repro`` with exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.cli import main
from conformance.contract import OpenConfig, SamplingParams, SpecConfig
from conformance.repro.record import check_file_name
from conformance.repro.scenario import (
    CHECKS,
    Abort,
    CloseSession,
    OpenSession,
    ReproFileError,
    Run,
    Scenario,
    Step,
    Submit,
    parse,
    to_json,
)

names = st.text("abc123-", min_size=1, max_size=6)
params = st.builds(SamplingParams, max_new_tokens=st.integers(1, 64),
                   temperature=st.sampled_from([0.0, 0.7]), top_k=st.sampled_from([-1, 5]),
                   top_p=st.sampled_from([1.0, 0.9]), seed=st.none() | st.integers(0, 9),
                   stop_token_ids=st.lists(st.integers(0, 100), max_size=2).map(tuple),
                   stop=st.lists(st.text("xyz\"\\", min_size=1, max_size=3), max_size=2)
                   .map(tuple), ignore_eos=st.booleans())
actions = st.one_of(
    st.builds(Submit, names, st.lists(st.integers(0, 2047), min_size=1, max_size=5).map(tuple),
              params, st.none() | names),
    st.builds(Step, st.integers(1, 9)), st.builds(Abort, names), st.builds(OpenSession, names),
    st.builds(CloseSession, names))
configs = st.builds(OpenConfig, model=st.just("tiny-code"),
                    spec=st.none() | st.just(SpecConfig()) | st.just(
                        SpecConfig(topk=4, num_draft_tokens=8, overlap=True)),
                    page_size=st.none() | st.sampled_from([1, 4]),
                    kv_pool_tokens=st.none() | st.integers(16, 9000),
                    retract_every=st.integers(0, 4))
scenarios = st.builds(Scenario, st.lists(st.builds(Run, configs, st.lists(actions, max_size=6)
                                                   .map(tuple)), min_size=1, max_size=2)
                      .map(tuple), names, st.text(max_size=20), names)


@settings(max_examples=60, deadline=None)
@given(scenarios)
def test_a_scenario_reads_back_as_written(scenario: Scenario) -> None:
    assert parse(to_json(scenario)) == scenario


def _doc(**top: object) -> dict[str, object]:
    run = {"config": {"model": "tiny-code"},
           "actions": [{"op": "submit", "rid": "a", "prompt_ids": [1, 2],
                        "params": {"max_new_tokens": 3}}, {"op": "step", "times": 2}]}
    return {"specgate_repro": 1, "runs": [run], **top}


def _with_accept_lens(lens: object, version: int = 2, spec: object = "chain",
                      temperature: float = 0.0, **top: object) -> str:
    """A file whose submit records ``lens`` (12 new tokens, under S=3 unless ``spec`` None)."""
    doc = _doc(specgate_repro=version, **top)
    run = doc["runs"][0]  # type: ignore[index]
    run["config"]["spec"] = None if spec is None else {  # type: ignore[index]
        "num_steps": 3, "num_draft_tokens": 4}
    run["actions"][0]["params"] = {"max_new_tokens": 12,  # type: ignore[index]
                                   "temperature": temperature}
    run["actions"][0]["accept_lens"] = lens  # type: ignore[index]
    return json.dumps(doc)


def _with_action(action: object) -> str:
    doc = _doc()
    doc["runs"][0]["actions"].append(action)  # type: ignore[index]
    return json.dumps(doc)


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not JSON"),
    ("[]", "not a specgate repro file"),
    (json.dumps({"runs": []}), "not a specgate repro file"),
    (json.dumps(_doc(specgate_repro=3)), "version 3 is not supported"),
    (json.dumps(_doc(specgate_repro=True)), "version True is not supported"),
    (json.dumps(_doc(specgate_repro=[1])), "version [1] is not supported"),
    (json.dumps(_doc(colour="red")), "unknown field 'colour'"),
    (json.dumps(_doc(checks=["invariants after every step"])), "checks: version 1 replays"),
    (json.dumps({"specgate_repro": 1, "runs": []}), "runs: expected a non-empty list"),
    (json.dumps({"specgate_repro": 1}), "missing field 'runs'"),
    (_with_action({"op": "teleport"}), "runs[0].actions[2]: unknown op 'teleport'"),
    (_with_action({"op": "step", "times": 0}),
     "actions[2].times: expected an integer from 1 to 100000"),
    (_with_action({"op": "abort"}), "actions[2]: missing field 'rid'"),
    (_with_action({"op": "abort", "rid": "a", "why": "x"}), "unknown field 'why'"),
    (_with_action({"op": "submit", "rid": "b", "prompt_ids": [1, -4]}),
     "actions[2].prompt_ids: expected a non-empty list of token ids"),
    (_with_action({"op": "submit", "rid": "b", "prompt_ids": [1],
                   "params": {"temperature": -1}}), "actions[2].params: temperature:"),
    (_with_action({"op": "submit", "rid": "b", "prompt_ids": [1],
                   "params": {"warmth": 1}}), "actions[2].params: unknown field 'warmth'"),
    (json.dumps({"specgate_repro": 1, "runs": [
        {"config": {"model": "tiny-code", "spec": {"num_steps": 3, "num_draft_tokens": 7}},
         "actions": []}]}), "runs[0].config.spec: num_draft_tokens:"),
    (json.dumps({"specgate_repro": 1, "runs": [
        {"config": {"model": "tiny-code", "page_size": -4}, "actions": []}]}),
     "runs[0].config.page_size: expected an integer from 0 to 4096"),
    (json.dumps({"specgate_repro": 1, "runs": [{"config": {}, "actions": []}]}),
     "runs[0].config: missing field 'model'"),
    (_with_accept_lens([2, 1], version=1), "'accept_lens' needs format version 2"),
    (_with_accept_lens([2, 1], checks=list(CHECKS[1])), "checks: version 2 replays exactly"),
    (_with_accept_lens([]), "accept_lens: expected a non-empty list of integers"),
    (_with_accept_lens("21"), "accept_lens: expected a non-empty list of integers"),
    (_with_accept_lens([2, 0]), "accept_lens[1]: expected an integer from 1 to 4"),
    (_with_accept_lens([5]), "accept_lens[0]: expected an integer from 1 to 4"),
    (_with_accept_lens([True]), "accept_lens[0]: expected an integer from 1 to 4"),
    (_with_accept_lens([4, 4, 4]), "12 tokens from verify steps, more than max_new_tokens 12"),
    (_with_accept_lens([2], spec=None), "greedy requests under speculation only"),
    (_with_accept_lens([2], temperature=0.7), "greedy requests under speculation only"),
])
def test_a_bad_file_is_one_line_naming_where(text: str, needle: str) -> None:
    with pytest.raises(ReproFileError) as caught:
        parse(text, "f.json")
    message = str(caught.value)
    assert needle in message and "\n" not in message and message.startswith("f.json"), message


@pytest.mark.parametrize("extra", [[], ["--emit-pytest"]])
def test_repro_refuses_a_bad_file_with_exit_2_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(_with_action({"op": "teleport"}))
    out = tmp_path / "out" / "test_emitted.py"
    code = main(["repro", str(bad), *([*extra, str(out)] if extra else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unknown op 'teleport'" in err[0], err
    assert not out.exists() and not out.parent.exists()


def test_repro_refuses_a_missing_file_and_a_bad_emit_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["repro", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc()))
    assert main(["repro", str(good), "--emit-pytest", str(tmp_path / "emitted.py")]) == 2
    assert "name it test_<letters, digits, _>.py" in capsys.readouterr().err
    assert not (tmp_path / "emitted.py").exists()


def test_check_file_names_are_safe_and_distinct() -> None:
    assert (check_file_name("test_lossless.py::test_past[plain-ctx512-retract]")
            == "test_lossless.test_past-plain-ctx512-retract.json")
    long_a, long_b = (check_file_name(f"test_x.py::test_y[{c * 300}]") for c in "ab")
    assert long_a != long_b and len(long_a) <= 125 and "/" not in long_a


@pytest.mark.parametrize("spec, needle", [("warp", "unknown spec 'warp'"),
                                          ("all", "a replay runs under one spec")])
def test_repro_refuses_a_bad_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  spec: str, needle: str) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc()))
    assert main(["repro", str(good), "--spec", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


CHAIN = OpenConfig(model="tiny-code", spec=SpecConfig(num_steps=3, num_draft_tokens=4))


def test_a_file_is_written_in_the_lowest_version_that_holds_it() -> None:
    plain = Submit("a", (1, 2), SamplingParams(max_new_tokens=12))
    v1 = Scenario((Run(CHAIN, (plain, Step(3))),))
    assert json.loads(to_json(v1))["specgate_repro"] == 1
    assert json.loads(to_json(v1))["checks"] == list(CHECKS[1])
    measured = Scenario((Run(CHAIN, (Submit("a", (1, 2), SamplingParams(max_new_tokens=12),
                                            accept_lens=(4, 1, 3)), Step(3))),))
    doc = json.loads(to_json(measured))
    assert doc["specgate_repro"] == 2 and doc["checks"] == list(CHECKS[2])
    assert doc["runs"][0]["actions"][0]["accept_lens"] == [4, 1, 3]
    assert parse(to_json(measured)) == measured and parse(to_json(v1)) == v1


def test_token_ids_are_one_line_of_the_file() -> None:
    def text(prompt: tuple[int, ...]) -> str:
        return to_json(Scenario((Run(CHAIN, (Submit("a", prompt), Step(2))),)))

    long = tuple(range(100, 160))
    assert f'"prompt_ids": {list(long)}' in text(long)
    assert len(text(long).splitlines()) == len(text((7,)).splitlines())
