"""The reference engine reproduces its golden acceptance traces exactly (syrupy, read-only).

Recording runs the whole default prompt set at once, as `specgate golden record` does, so the
batch composition — and therefore every float — is the recorded one. The chain (S=3, N=4)
trace runs by default; the other three configurations are `slow`.
"""

from __future__ import annotations

import pytest

from conformance.checks import golden
from conformance.run.specs import SPECS, config_id

CONFIGS = [c for name in ("eagle", "eagle-tree") for c in SPECS[name].configs]


@pytest.fixture
def golden_snapshot(snapshot):  # type: ignore[no-untyped-def]
    return snapshot.use_extension(golden.syrupy_extension())


@pytest.mark.parametrize("config", [
    pytest.param(c, id=config_id(c), marks=() if i == 0 else pytest.mark.slow)
    for i, c in enumerate(CONFIGS)])
def test_golden_trace_reproduces(config, golden_snapshot) -> None:  # type: ignore[no-untyped-def]
    trace = golden.record(config, "default")
    assert trace == golden_snapshot
