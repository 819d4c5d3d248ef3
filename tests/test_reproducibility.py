"""The reproducibility tier has teeth: the reference engine passes it, and each check fails on a
backend that breaks what it guards (the bug zoo's seed mutants, and two seed bugs defined here:
one seed for every request, a fresh seed at every retraction). A backend that ignores
temperature and seed (every stream the likeliest one) fails the collision checks for what it
does, on the bundled model and under ``--model``: the chance of a collision comes from the
reference oracle, never from the backend's own streams."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plugin import run_suite

from conformance.backends.mutants import Mutant, MutantBackend
from refengine import Engine
from refengine.memory.manager import KVManager
from refengine.request import Req
from refengine.scheduler import Scheduler

pytest_plugins = ["pytester"]
# The random model is built (importing transformers) before any in-process suite run: pytester
# drops the modules a run imported, and transformers imported after that fails to load.
pytestmark = pytest.mark.usefixtures("random_model_dir")

TIER = Path(__file__).resolve().parents[1] / "conformance" / "suites" / "test_reproducibility.py"


class _OneSeed(Scheduler):
    def add(self, req: Req) -> None:
        req.seed = 0  # every request, seeded or not, draws from the same seed
        super().add(req)


class _ReseedsOnRetract(KVManager):
    def retract(self, req: Req) -> None:
        req.seed += 1  # a retracted request resumes with another seed
        super().retract(req)


class OneSeedForAll(Engine):
    scheduler_class = _OneSeed


class ReseedsOnRetract(Engine):
    kv_manager_class = _ReseedsOnRetract


def one_seed_for_all() -> MutantBackend:
    return MutantBackend(Mutant("one_seed_for_all", OneSeedForAll))


def reseeds_on_retract() -> MutantBackend:
    return MutantBackend(Mutant("reseeds_on_retract", ReseedsOnRetract))


def checks(pytester: pytest.Pytester, backend: str, spec: str = "none",
           model: Path = Path("tiny-code")) -> dict[str, dict]:
    """The tier's checks on ``backend`` (gate profile): check name -> its row."""
    (pytester.path / "none.ini").write_text("[pytest]\n")
    _, results = run_suite(pytester, backend, model, "--specgate-spec", spec,
                           "-k", "test_reproducibility", str(TIER))
    return {str(c["nodeid"]).rsplit("::", 1)[1]: c for c in results["checks"]}


def outcomes(pytester: pytest.Pytester, backend: str, spec: str = "none") -> dict[str, str]:
    """The tier's checks on ``backend`` (tiny-code, gate profile): check name -> outcome."""
    return {name: str(row["outcome"]) for name, row in checks(pytester, backend, spec).items()}


def test_the_reference_engine_passes(pytester: pytest.Pytester) -> None:
    got = outcomes(pytester, "refengine")
    assert got == {"test_seed_fixes_the_stream_whatever_the_batch": "passed",
                   "test_seed_fixes_the_stream_with_top_k_alone": "passed",
                   "test_seed_fixes_the_stream_across_retraction": "passed",
                   "test_different_seeds_give_different_streams": "passed",
                   "test_unseeded_requests_do_not_collide": "passed"}, got


@pytest.mark.parametrize(("backend", "spec"), [("mutant:seed_ignored", "none"),
                                               ("mutant:seed_by_batch_row", "eagle")])
def test_an_ignored_seed_fails_the_batch_check(pytester: pytest.Pytester, backend: str,
                                               spec: str) -> None:
    got = outcomes(pytester, backend, spec)
    assert got["test_seed_fixes_the_stream_whatever_the_batch"] == "failed", got
    assert got["test_different_seeds_give_different_streams"] == "passed", got


def test_a_top_k_only_path_at_the_batch_max_fails_the_top_k_check(
        pytester: pytest.Pytester) -> None:
    """Top-k thresholded at the batch's largest k when no request sets top-p: the top-k check's
    batch (no top-p) shows it; the mixed batch (a top-p neighbour) cannot."""
    got = outcomes(pytester, "mutant:verify_top_k_alone_at_batch_max", "eagle")
    assert got["test_seed_fixes_the_stream_with_top_k_alone"] == "failed", got
    assert got["test_seed_fixes_the_stream_whatever_the_batch"] == "passed", got


def test_one_seed_for_all_fails_both_collision_checks(pytester: pytest.Pytester) -> None:
    got = outcomes(pytester, "tests.test_reproducibility:one_seed_for_all")
    assert got["test_different_seeds_give_different_streams"] == "failed", got
    assert got["test_unseeded_requests_do_not_collide"] == "failed", got
    assert got["test_seed_fixes_the_stream_whatever_the_batch"] == "passed", got


def test_a_new_seed_at_retraction_fails_the_retraction_check(pytester: pytest.Pytester) -> None:
    got = outcomes(pytester, "tests.test_reproducibility:reseeds_on_retract")
    assert got["test_seed_fixes_the_stream_across_retraction"] == "failed", got
    assert got["test_seed_fixes_the_stream_whatever_the_batch"] == "passed", got


def _fails_for_identical_streams(rows: dict[str, dict]) -> None:
    """Both collision checks fail on what the backend did: every stream identical, where the
    oracle puts the chance of one honest pair coinciding far below the bound."""
    for name in ("test_different_seeds_give_different_streams",
                 "test_unseeded_requests_do_not_collide"):
        row = rows[name]
        assert row["outcome"] == "failed", rows
        assert "15 of 15 pairs gave identical 16-token streams" in row["message"], row
        assert float(row["figures"]["collision_chance"][0]) < 1e-6, row


def test_ignoring_temperature_and_seed_fails_on_the_bundled_model(
        pytester: pytest.Pytester) -> None:
    _fails_for_identical_streams(checks(pytester, "mutant:ignores_temperature_and_seed"))


def test_ignoring_temperature_and_seed_fails_under_another_model(
        pytester: pytest.Pytester, random_model_dir: Path) -> None:
    """Under ``--model``: failed, not "not applicable"."""
    _fails_for_identical_streams(checks(pytester, "mutant:ignores_temperature_and_seed",
                                        model=random_model_dir))
