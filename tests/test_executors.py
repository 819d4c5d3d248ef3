"""The executor registry (``refengine/graph/executors.py``): importable without torch, the one
list the configuration, the suite's case timeouts and the graph runner read, and every entry
accepted by ``EngineConfig`` on the devices it runs on and refused, in one line, elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance.run.case_timeout import DEFAULT_SECONDS, default_seconds
from refengine.config import GRAPH_EXECUTORS, EngineConfig
from refengine.graph.executors import (
    EXECUTORS,
    default_executor,
    executor_info,
    executor_names,
)

REPO = Path(__file__).resolve().parents[1]
DEVICES = {"cpu": "cpu", "cuda": "cuda:0"}


def test_the_registry_imports_no_torch() -> None:
    """The configuration and the CLI read it before (or without) loading torch."""
    code = ("import sys, refengine.graph.executors, refengine.config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_configuration_takes_its_names_from_the_registry() -> None:
    assert GRAPH_EXECUTORS == executor_names() == tuple(EXECUTORS)
    assert set(GRAPH_EXECUTORS) == {"compiled", "frozen", "replay", "cuda", "aot"}


@pytest.mark.parametrize("name", list(EXECUTORS))
@pytest.mark.parametrize("kind", list(DEVICES))
def test_every_entry_is_accepted_where_it_runs_and_refused_elsewhere(name: str,
                                                                      kind: str) -> None:
    info, device = executor_info(name), DEVICES[kind]
    if info.device in ("any", kind):
        assert info.runs_on(device) and info.device_problem(device) is None
        assert EngineConfig(device=device, cuda_graph=True, graph_executor=name
                            ).graph_executor == name
        return
    problem = info.device_problem(device)
    assert problem is not None and "\n" not in problem
    with pytest.raises(ValueError, match=r"^graph_executor: ") as err:
        EngineConfig(device=device, cuda_graph=True, graph_executor=name)
    assert str(err.value) == f"graph_executor: {problem}"


def test_each_device_has_one_default_that_runs_there() -> None:
    for kind, device in DEVICES.items():
        default = default_executor(device)
        assert [n for n, i in EXECUTORS.items() if i.default_on == kind] == [default]
        assert executor_info(default).runs_on(device)
        assert EngineConfig(device=device).graph_executor == default


def test_an_unknown_name_is_one_line_naming_every_executor() -> None:
    with pytest.raises(ValueError, match="graph executor: one of compiled, frozen, replay, "
                       "cuda, aot, got 'tensorrt'"):
        executor_info("tensorrt")


def test_case_timeouts_follow_the_timeout_factor() -> None:
    """Executors that compile do it inside the first checks that meet each shape."""
    for profile, seconds in DEFAULT_SECONDS.items():
        assert default_seconds(profile, None) == seconds
        for name, info in EXECUTORS.items():
            assert default_seconds(profile, name) == seconds * info.timeout_factor
            assert info.timeout_factor == (4 if info.compiles else 1)
