"""The bugs planted in vLLM (``tests/vllm_planted.py``) really change vLLM's behaviour, and the
certification catches them (docs/backends/vllm.md, "Planted bugs").

Unit checks call the patched vLLM functions on crafted inputs, beside the unpatched ones; the
KV check drives one small vLLM engine. ``-m slow`` runs the certification's killing checks
against the planted backends, and the same checks against clean vLLM. Everything skips without
vLLM (a separate venv, docs/backends/vllm.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.ngram_drafts import common_proposal
from tests import vllm_planted

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CPU build: "
                                "docs/backends/vllm.md)")

PROMPT = (481, 368, 394, 63, 940, 63, 70, 1576, 63, 70, 1576, 8)


def test_every_plant_is_documented_and_undone() -> None:
    import vllm.v1.core.sched.scheduler as sched
    import vllm.v1.sample.rejection_sampler as rs
    import vllm.v1.spec_decode.eagle as eagle
    import vllm.v1.spec_decode.ngram_proposer as ngram

    def state() -> tuple[object, ...]:
        return (rs.rejection_sample, ngram.batch_propose_numba, sched.Scheduler.schedule,
                sched.Scheduler._free_request_blocks, eagle.EagleProposer.set_inputs_first_pass)

    clean = state()
    for name, plant in vllm_planted.PLANTS.items():
        assert callable(getattr(vllm_planted, name)), name       # the backend factory
        assert plant.patch_point.startswith("vllm/") and plant.bug_class and plant.breaks
        with vllm_planted.planted(name):
            assert state() != clean, name
        assert state() == clean, name


# --- 1. rejection sampler --------------------------------------------------------------------

def _greedy_rejection(draft: list[list[int]], target: list[list[int]], bonus: list[int]
                      ) -> list[list[int]]:
    """vLLM's ``rejection_sample`` (greedy, CPU kernel) on crafted drafts and target argmaxes."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.import_kernels()                      # vLLM's C++ ops, as a CPU worker
    vocab = 64
    flat_target = [t for row in target for t in row]
    logits = torch.full((len(flat_target), vocab), -1.0)
    logits[torch.arange(len(flat_target)), torch.tensor(flat_target)] = 1.0
    counts = [len(row) for row in draft]
    out = rejection_sampler.rejection_sample(
        torch.tensor([d for row in draft for d in row], dtype=torch.int32), counts, max(counts),
        torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32), None, logits,
        torch.tensor(bonus, dtype=torch.int64)[:, None],
        SimpleNamespace(all_greedy=True, all_random=False, temperature=None, generators={}))
    return [[t for t in row if t >= 0] for row in out.tolist()]


def test_rejection_sampler_accepts_one_draft_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through vLLM's ``rejection_sample`` and its CPU greedy kernel, called directly: the
    kernel registry a worker fills at start-up is not needed (nor touched) here."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(rejection_sampler, "_rejection_greedy_sample",
                        cpu_triton_utils._rejection_greedy_sample_kernel_impl)
    draft = [[5, 7, 9], [4, 6, 8], [3, 3, 3]]
    target = [[5, 8, 9], [4, 6, 8], [3, 3, 2]]
    bonus = [11, 12, 13]
    clean = _greedy_rejection(draft, target, bonus)
    with vllm_planted.planted("rejection_accepts_one_more"):
        planted = _greedy_rejection(draft, target, bonus)
    assert clean == [[5, 8], [4, 6, 8, 12], [3, 3, 2]]
    # row 0: draft 7 (rejected) kept, then the target's token after it; row 2: the last draft
    # rejected, kept, then the bonus; a fully accepted row is unchanged
    assert planted == [[5, 7, 9], [4, 6, 8, 12], [3, 3, 3, 13]]


# --- 2. n-gram proposer ----------------------------------------------------------------------

def _ngram(context: list[int], k: int) -> list[int]:
    import numpy as np
    from vllm.v1.spec_decode import ngram_proposer

    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, :len(context)] = context
    drafts = np.zeros((1, k), dtype=np.int32)
    counts = np.zeros(1, dtype=np.int32)
    ngram_proposer.batch_propose_numba([0], np.array([len(context)], dtype=np.int32), tokens,
                                       1, 3, 64, k, drafts, counts)
    return drafts[0, :counts[0]].tolist()


def test_ngram_proposer_copies_one_position_late() -> None:
    context = [7, 8, 9, 10, 11, 12, 7, 8]
    assert _ngram(context, 3) == [9, 10, 11]
    with vllm_planted.planted("ngram_one_position_late"):
        assert _ngram(context, 3) == [10, 11, 12]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6))
def test_ngram_proposer_starts_with_what_every_lookup_proposes(context: list[int],
                                                               steps: int) -> None:
    """What the lossless tier's n-gram check rests on (``conformance/checks/ngram_drafts.py``)
    holds for vLLM's own lookup: where the rule says every correct drafter proposes ``P``
    first, vLLM's proposal starts with ``P``."""
    proposal = common_proposal(context, steps)
    if proposal is not None:
        assert _ngram(context, steps)[:len(proposal)] == list(proposal)


# --- 4. EAGLE proposer -----------------------------------------------------------------------

class _FakeProposer:
    """The attributes ``set_inputs_first_pass`` reads on its default (EAGLE) pathway."""

    def __init__(self) -> None:
        import torch
        self.use_heterogeneous_vocab = False
        self.needs_extra_input_slots = False
        self.input_ids = torch.zeros(8, dtype=torch.int64)
        self.hidden_states = torch.zeros(8, 2)
        self.positions = torch.zeros(8, dtype=torch.int64)

    def _set_positions(self, num_tokens: int, positions: object) -> None:
        self.positions[:num_tokens] = positions


def _first_pass_features() -> list[float]:
    import torch
    from vllm.v1.spec_decode.eagle import EagleProposer

    proposer = _FakeProposer()
    hidden = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 2)    # row i: i
    cad = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 5]))          # requests of 3, 2
    EagleProposer.set_inputs_first_pass(
        proposer, torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7]),
        torch.tensor([0, 1, 2, 0, 1]), hidden, None, cad, None)
    return proposer.hidden_states[:5, 0].tolist()


def test_eagle_proposer_reads_the_previous_positions_hidden_state() -> None:
    assert _first_pass_features() == [0, 1, 2, 3, 4]
    with vllm_planted.planted("eagle_reads_previous_hidden"):
        # each request's first token keeps its own; every other one reads its predecessor's
        assert _first_pass_features() == [0, 0, 1, 3, 3]


# --- 3. KV freed one step late (one small engine, in a process of its own) --------------------

def _free_after_finish(handle: Any) -> tuple[int, int]:
    """Run one short request to its finish; -> (free blocks, usable blocks) right after."""
    from conformance.contract import FinishEvent, Request
    from specwire import SamplingParams

    handle.submit(Request("r", PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)))
    for _ in range(50):
        if any(isinstance(e, FinishEvent) for e in handle.step()):
            blocks = handle.kv_blocks()
            return int(blocks["free_blocks"]), int(blocks["num_blocks"]) - 1
    raise AssertionError("the request did not finish")


def _driver_verdict(backend: Any) -> str:
    """Six requests of staggered lengths through the suite's driver, which checks M1-M3 after
    every step and M4/M5 once idle; -> "ok" or the first invariant's message."""
    from conformance.checks.invariants import InvariantError
    from conformance.contract import OpenConfig
    from conformance.repro.driver import Driver
    from specwire import SamplingParams

    handle = backend.open(OpenConfig(max_running_requests=8))
    driver = Driver(handle, backend.capabilities())
    try:
        for i in range(6):
            driver.submit(f"r{i}", list(PROMPT[:6 + i]),
                          SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True))
        driver.run(max_steps=500)
    except InvariantError as err:
        return str(err)
    finally:
        handle.close()
    return "ok"


def kv_probe() -> None:
    """Free blocks right after a finish, clean and planted, and after the planted engine's next
    step; then the suite's memory invariants over a clean and a planted run. Printed as JSON
    (run by the test below in a fresh interpreter)."""
    from conformance.backends.vllm import backend
    from conformance.contract import OpenConfig, Request
    from specwire import SamplingParams

    made = backend()
    handle = made.open(OpenConfig(max_running_requests=2))
    try:
        clean_free, usable = _free_after_finish(handle)
        with vllm_planted.planted("kv_freed_one_step_late"):
            planted_free, _ = _free_after_finish(handle)
            handle.submit(Request("s", PROMPT, SamplingParams(max_new_tokens=8,
                                                              ignore_eos=True)))
            handle.step()                           # the next schedule() frees them
            blocks = handle.kv_blocks()
            next_free = int(blocks["free_blocks"]) + int(blocks["requests"]["s"]["blocks"][0])
    finally:
        handle.close()
    clean_verdict = _driver_verdict(made)
    with vllm_planted.planted("kv_freed_one_step_late"):
        planted_verdict = _driver_verdict(made)
    print(json.dumps({"usable": usable, "clean": clean_free, "planted": planted_free,
                      "next_step": next_free, "clean_invariants": clean_verdict,
                      "planted_invariants": planted_verdict}))


def test_finished_request_blocks_are_freed_one_step_late() -> None:
    """In a fresh interpreter: vLLM 0.32 cannot start its first engine in a process that has
    already imported numba (its n-gram proposer, the n-gram test here), see
    docs/backends/vllm.md."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", "from tests.test_vllm_planted import kv_probe; "
                           "kv_probe()"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["clean"] == seen["usable"]          # clean vLLM: freed in the finishing step
    assert seen["planted"] < seen["usable"]         # planted: still held after the finish
    assert seen["next_step"] == seen["usable"]      # and back at the next step
    assert seen["clean_invariants"] == "ok"
    assert "M1 conservation" in seen["planted_invariants"], seen["planted_invariants"]


# --- the certification kills each plant; clean vLLM passes the same checks -------------------

def _certify(tmp_path: Path, factory: str, spec: str, only: tuple[str, ...]) -> dict[str, str]:
    from conformance.plan.run_plan import RunPlan
    from conformance.run.suite import SuiteOptions, run_suite

    tmp_path.mkdir(parents=True, exist_ok=True)
    head = EAGLE_HEAD if spec == "eagle" else None
    run = run_suite(SuiteOptions(RunPlan(factory, (spec,), draft_model=head, only=only)),
                    tmp_path / "results.json")
    assert run.results is not None, run.problems
    return {c.nodeid: c.outcome for c in run.results.checks}


# EAGLE runs with the head vLLM drafts with as refengine does, so the golden tier applies.
EAGLE_HEAD = "tiny-code-eagle-vllm"
KILLS = [
    ("rejection_accepts_one_more", "draft-model",
     "test_lossless.py::test_greedy_matches_reference[draft-n4-batch-1]"),
    ("eagle_reads_previous_hidden", "eagle",
     "test_golden.py::test_acceptance_matches_golden[chain-s3-n4]"),
    ("ngram_one_position_late", "ngram",
     "test_lossless.py::test_ngram_steps_accept_what_every_lookup_proposes[ngram-n4]"),
    ("kv_freed_one_step_late", "none", "test_memory.py::test_invariants_under_pressure[plain-1]"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("plant", "spec", "check"), KILLS, ids=[k[0] for k in KILLS])
def test_certification_kills_the_plant(plant: str, spec: str, check: str,
                                       tmp_path: Path) -> None:
    """The suite runs in this process, so the plant is undone after its run."""
    clean = _certify(tmp_path / "clean", "conformance.backends.vllm:backend", spec, (check,))
    try:
        planted = _certify(tmp_path / "planted", f"tests.vllm_planted:{plant}", spec, (check,))
    finally:
        vllm_planted.uninstall(plant)
    assert clean == {check: "passed"}
    assert planted == {check: "failed"}
