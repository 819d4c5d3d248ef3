"""The reference engine reproduces its golden acceptance traces exactly (syrupy, read-only).

Recording runs each trace's requests as `specgate golden record` does (the plain trace: the
whole default prompt set at once), so the batch composition — and therefore every float — is
the recorded one. The chain (S=3, N=4) traces run by default; the other configurations (EAGLE
trees, n-gram chains) are `slow`.
"""

from __future__ import annotations

import pytest

from conformance.checks import golden
from conformance.checks.golden_scenarios import SCENARIOS
from conformance.plan.specs import SPECS, config_id

CONFIGS = [c for name in ("eagle", "eagle-tree", "ngram") for c in SPECS[name].configs]
CONFIG_PARAMS = [pytest.param(c, id=config_id(c), marks=() if i == 0 else pytest.mark.slow)
                 for i, c in enumerate(CONFIGS)]


@pytest.fixture
def golden_snapshot(snapshot):  # type: ignore[no-untyped-def]
    return snapshot.use_extension(golden.syrupy_extension())


@pytest.mark.parametrize("config", CONFIG_PARAMS)
def test_golden_trace_reproduces(config, golden_snapshot) -> None:  # type: ignore[no-untyped-def]
    trace = golden.record(config, "default")
    assert trace == golden_snapshot


def _scenario_reproduces(config, snapshot, name: str) -> None:  # type: ignore[no-untyped-def]
    scenario = SCENARIOS[name]
    extension = golden.syrupy_extension(scenario.trace_name("default"))
    assert golden.record(config, "default", scenario=scenario) == snapshot.use_extension(extension)


@pytest.mark.parametrize("config", CONFIG_PARAMS)
def test_chunked_trace_reproduces(config, snapshot) -> None:  # type: ignore[no-untyped-def]
    _scenario_reproduces(config, snapshot, "chunked")


@pytest.mark.parametrize("config", CONFIG_PARAMS)
def test_session_trace_reproduces(config, snapshot) -> None:  # type: ignore[no-untyped-def]
    _scenario_reproduces(config, snapshot, "sessions")


@pytest.mark.parametrize("config", CONFIG_PARAMS)
def test_retraction_trace_reproduces(config, snapshot) -> None:  # type: ignore[no-untyped-def]
    _scenario_reproduces(config, snapshot, "retract")
