"""The fuzz tier has teeth: with no case written for them, it finds bug-zoo mutants by itself,
shrinks each to a handful of driver actions, and the repro file it leaves reproduces the bug and
replays clean on the reference engine. (Slow: each failure is shrunk for up to the gate
profile's 90 s.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.plan.registry import load_backend
from conformance.repro.replay import replay
from conformance.repro.scenario import load
from conformance.run.suite import suite_dir

MOST_ACTIONS = 12

# mutant -> the spec it runs under: a slot leaked at finish, a committed length left stale by
# retraction, an overlap step's stale result applied to a finished request
FOUND = {"leak_on_finish": "none", "retract_stale_committed": "none",
         "stale_result_applied": "eagle-v2"}


def _fuzz(backend: str, spec: str, out: Path) -> dict[str, object]:
    """The fuzz tier alone against ``backend``; -> its row in the results."""
    results = out / "results.json"
    args = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(suite_dir()),
            str(suite_dir() / "test_fuzz.py"), "-p", "no:cacheprovider", "-p", "no:xdist",
            "-p", "no:randomly", "--specgate-backend", backend, "--specgate-spec", spec,
            "--specgate-repro-dir", str(out), "--specgate-results", str(results), "-q"]
    subprocess.run(args, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                   text=True, check=False)
    (row,) = json.loads(results.read_text())["checks"]
    return row


@pytest.mark.slow
@pytest.mark.parametrize("mutant", sorted(FOUND))
def test_the_fuzz_tier_finds_and_shrinks(mutant: str, tmp_path: Path) -> None:
    row = _fuzz(f"mutant:{mutant}", FOUND[mutant], tmp_path)
    assert row["outcome"] == "failed", row
    assert row["repro_reproduces"] is True, row
    scenario = load(tmp_path / str(row["repro"]))
    assert scenario.action_count <= MOST_ACTIONS, (scenario.action_count, scenario.runs)
    assert replay(scenario, load_backend(f"mutant:{mutant}")) is not None
    assert replay(scenario, load_backend("refengine")) is None
