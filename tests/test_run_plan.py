"""The run plan: built and checked once (``build_plan``), handed to the pytest session as one
file (``--specgate-plan``), refused in one line when that file is not a plan; the plain pytest
options make the same plan through the same check."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from conformance.plan.run_plan import RunPlan, build_plan
from conformance.plan.usage import UsageError
from conformance.run.suite import SuiteOptions, suite_args

pytest_plugins = ["pytester"]

PLAN = RunPlan("refengine", ("eagle",), profile="full", draft_model="tiny-code-eagle-vllm",
               graph_executor="replay", case_timeout=12.5, workers=2, only=("test_a.py::x",),
               keyword="stop", known_failures="known.toml", strict_known=True,
               require="outputs")


def plugin_args() -> list[str]:
    """The plugin explicitly only where no installed entry point loads it already."""
    installed = any(ep.name == "specgate" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.run.plugin"]


def test_a_plan_survives_its_file(tmp_path: Path) -> None:
    PLAN.save(tmp_path / "plan.json")
    assert RunPlan.load(tmp_path / "plan.json") == PLAN


def _written(tmp_path: Path, **changes: object) -> Path:
    data = {"plan_version": 1, **asdict(PLAN), **changes}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not _DROP}))
    return path


_DROP = object()


@pytest.mark.parametrize("changes, needle", [
    ({"plan_version": 2}, "not a specgate run plan of version 1"),
    ({"workers": "2"}, "plan field 'workers': expected int, got '2'"),
    ({"workers": True}, "plan field 'workers'"),
    ({"strict_known": 1}, "plan field 'strict_known': expected bool"),
    ({"specs": ["eagle", 3]}, "plan field 'specs'"),
    ({"specs": ["warp"]}, "plan specs: unknown ['warp']"),
    ({"specs": []}, "plan specs: unknown []"),
    ({"profile": "sometimes"}, "plan profile: unknown 'sometimes'"),
    ({"graph_executor": "magic"}, "plan graph_executor: unknown 'magic'"),
    ({"device": _DROP}, "plan fields missing ['device']"),
    ({"colour": "blue"}, "unknown ['colour']"),
])
def test_a_file_that_is_no_plan_is_refused_in_one_line(tmp_path: Path, changes: dict[str, object],
                                                       needle: str) -> None:
    path = _written(tmp_path, **changes)
    with pytest.raises(ValueError) as refused:
        RunPlan.load(path)
    message = str(refused.value)
    assert needle in message and message.startswith(str(path)) and "\n" not in message


def test_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"plan\.json"):
        RunPlan.load(tmp_path / "plan.json")


def test_build_resolves_what_was_asked(random_model_dir: Path) -> None:
    asked = RunPlan("refengine", model=str(random_model_dir))
    plan = build_plan(asked, "claimed", "auto")
    assert plan == replace(asked, specs=plan.specs, graph_executor="aot")
    assert plan.specs[0] == "none" and "eagle" in plan.specs
    assert build_plan(asked, "eagle", "none") == replace(asked, specs=("eagle",))
    assert build_plan(asked, "all", None).graph_executor is None


@pytest.mark.parametrize("spec, graphs, changes, needle", [
    ("warp", None, {}, "unknown spec 'warp'"),
    ("none", "replay", {"backend": "hf"}, "does not claim graph_runner"),
    ("none", "cuda", {}, "--graphs cuda: CUDA graphs need a CUDA device (add --device cuda)"),
    ("none", None, {"model": "no-such-fixture"}, "no-such-fixture"),
    ("none", None, {"strict_known": True}, "--strict-known needs --known-failures FILE"),
])
def test_build_refuses_in_one_line(random_model_dir: Path, spec: str, graphs: str | None,
                                   changes: dict[str, object], needle: str) -> None:
    asked = replace(RunPlan("refengine", model=str(random_model_dir)), **changes)
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        build_plan(asked, spec, graphs)


def test_the_session_gets_the_plan_as_one_option(tmp_path: Path) -> None:
    args = suite_args(SuiteOptions(PLAN, repro_dir="rep"), tmp_path / "results.json", None)
    assert RunPlan.load(Path(args[args.index("--specgate-plan") + 1])) == PLAN
    run_options = ("--specgate-backend", "--specgate-spec", "--specgate-profile",
                   "--specgate-model", "--specgate-draft-model", "--specgate-graphs",
                   "--specgate-device", "--specgate-case-timeout")
    assert not set(run_options) & set(args)


def test_pytest_refuses_a_plan_file_that_is_no_plan(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    (pytester.path / "plan.json").write_text('{"plan_version": 1}')
    result = pytester.runpytest_inprocess(*plugin_args(), "--specgate-plan", "plan.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "plan.json: plan fields missing" in result.stderr.str()


def test_plain_options_are_checked_by_the_same_build(pytester: pytest.Pytester) -> None:
    """What certify refuses before any work, plain pytest refuses before its first check."""
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*plugin_args(), "--specgate-backend", "hf",
                                          "--specgate-graphs", "replay")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--graphs: backend 'hf' does not claim graph_runner" in result.stderr.str()
