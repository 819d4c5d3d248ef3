"""The memory tier under pressure: the configuration it picks (the largest per-step KV need),
what counts as pressure (retracting or queueing, both conforming), a backend that queues
instead of retracting passes, and a pool too big for pressure, a leak, a room check without
the draft scratch and a length check short of the context limit all fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_plugin import run_suite

from conformance.backends.refengine import RefEngineBackend, RefEngineHandle
from conformance.contract import MemoryView, OpenConfig, ReqKV, SpecConfig
from conformance.plan.specs import SPECS, config_id
from conformance.run.pressure import PressureWitness, step_kv_need, widest_config

pytest_plugins = ["pytester"]

PRESSURE = "test_memory.py::test_invariants_under_pressure"
TO_LIMIT = "test_memory.py::test_invariants_past_context_boundary"


class IgnoresPoolSize(RefEngineBackend):
    """Opens every engine with the default pool, whatever the check asks: nothing is ever
    under pressure."""

    name = "ignores-pool-size"

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        return super().open(replace(cfg, kv_pool_tokens=None))


def ignores_pool_size() -> IgnoresPoolSize:
    return IgnoresPoolSize()


def test_the_widest_configuration_is_the_largest_per_step_kv_need() -> None:
    widest = {name: config_id(widest_config(spec.configs)) for name, spec in SPECS.items()}
    assert widest == {"none": "plain", "eagle": "chain-s5-n6", "eagle-tree": "tree-s5-k8-n16",
                      "eagle-v2": "tree-s3-k4-n8-v2", "eagle3": "eagle3-chain-s5-n6",
                      "eagle3-tree": "eagle3-tree-s5-k8-n16", "mtp": "mtp-tree-s3-k4-n8",
                      "draft-model": "draft-n6", "ngram": "ngram-n6"}
    tree = SpecConfig(algorithm="eagle", num_steps=5, topk=8, num_draft_tokens=16)
    assert step_kv_need(None) == 1
    assert step_kv_need(tree) == 40  # the draft tree's levels, past the 16-token verify block
    chain = SpecConfig(algorithm="eagle", num_steps=3, topk=1, num_draft_tokens=4, overlap=True)
    assert step_kv_need(chain) == 1 + 2 * 4  # the overlap reservation


def _view(free: int, holding: tuple[str, ...], listed_empty: tuple[str, ...] = ()
          ) -> MemoryView:
    """``listed_empty``: waiting requests the view lists with zero KV."""
    return MemoryView(capacity=100, free=free, held=0, page_size=1,
                      requests={**{rid: ReqKV(10, 10) for rid in holding},
                                **{rid: ReqKV(0, 0, "prefill") for rid in listed_empty}})


def test_pressure_is_a_retraction_or_a_request_the_free_pool_cannot_hold() -> None:
    witness = PressureWitness({"a": 10, "b": 40})
    witness.observe(_view(free=50, holding=("a",)), live={"a", "b"})  # b waits, but would fit
    witness.observe(_view(free=30, holding=("a", "b")), live={"a", "b"})  # nobody waits
    assert not witness.applied(retractions=0)
    assert witness.applied(retractions=1)
    witness.aborted.add("b")
    witness.observe(_view(free=30, holding=("a",)), live={"a", "b"})  # b is being aborted
    assert not witness.applied(retractions=0)
    witness.aborted.clear()
    witness.observe(_view(free=30, holding=("a",)), live={"a", "b"})
    assert witness.queued_steps == 1 and witness.applied(retractions=0)


def test_a_request_listed_with_zero_kv_waits() -> None:
    """The contract lets a view list a waiting request with zero KV rather than leave it out:
    it waits all the same."""
    witness = PressureWitness({"a": 10, "b": 40})
    witness.observe(_view(free=50, holding=("a",), listed_empty=("b",)), live={"a", "b"})
    assert witness.queued_steps == 0  # it would fit
    witness.observe(_view(free=30, holding=("a",), listed_empty=("b",)), live={"a", "b"})
    assert witness.queued_steps == 1


def _memory_outcomes(pytester: pytest.Pytester, backend: str, model: Path, *extra: str
                     ) -> tuple[dict[str, dict], int]:
    (pytester.path / "none.ini").write_text("[pytest]\n")
    res, results = run_suite(pytester, backend, model, "--specgate-profile", "gate", *extra)
    return {c["nodeid"].split("/")[-1]: c for c in results["checks"]}, res.ret


@pytest.mark.parametrize("variant", ["queueing", "queueing_lists_waiting"])
def test_a_backend_that_queues_instead_of_retracting_passes(pytester: pytest.Pytester,
                                                            random_model_dir: Path,
                                                            variant: str) -> None:
    """Whether its memory view leaves waiting requests out or lists them with zero KV."""
    checks, ret = _memory_outcomes(pytester, f"tests.conforming_variants:{variant}",
                                   random_model_dir, "-k", "test_memory and not aborts")
    assert ret == pytest.ExitCode.OK, {k: c["message"] for k, c in checks.items()}
    assert checks and {c["outcome"] for c in checks.values()} == {"passed"}, checks
    figures = [c["figures"] for c in checks.values()]
    assert all(f["retractions"] == 0 and f["queued_steps"] > 0 for f in figures), figures


def test_a_pool_too_big_for_pressure_fails(pytester: pytest.Pytester,
                                          random_model_dir: Path) -> None:
    checks, _ = _memory_outcomes(pytester, "tests.test_memory_pressure:ignores_pool_size",
                                 random_model_dir, "-k", "test_invariants_under_pressure")
    assert checks and {c["outcome"] for c in checks.values()} == {"failed"}, checks
    assert all("nothing was checked under pressure" in c["message"] for c in checks.values())


def test_a_leak_still_fails_under_pressure(pytester: pytest.Pytester,
                                          random_model_dir: Path) -> None:
    checks, _ = _memory_outcomes(pytester, "mutant:leak_on_finish", random_model_dir,
                                 "-k", "test_invariants_under_pressure")
    assert checks and {c["outcome"] for c in checks.values()} == {"failed"}, checks
    assert all("M1 conservation" in c["message"] for c in checks.values()), checks


@pytest.mark.parametrize(("mutant", "spec", "check"), [
    ("room_counts_verify_block_only", "eagle-tree", f"{PRESSURE}[tree-s5-k8-n16-1]"),
    ("ends_short_of_context_limit", "none", f"{TO_LIMIT}[plain-ctx2048]")])
def test_zoo_twins_are_killed_by_the_gate(pytester: pytest.Pytester, mutant: str, spec: str,
                                          check: str) -> None:
    checks, _ = _memory_outcomes(pytester, f"mutant:{mutant}", Path("tiny-code"),
                                 "--specgate-spec", spec, "-p", "conformance.run.only",
                                 "--specgate-only", check)
    assert [(k, c["outcome"]) for k, c in checks.items()] == [(check, "failed")], checks
