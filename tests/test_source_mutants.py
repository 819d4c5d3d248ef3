"""Source-patch mutants: edits apply to a copy of refengine or fail with one line, the copy is
what the suite's subprocess imports, and a bug planted in a path the oracle's engine shares
(the sampler's greedy argmax) is killed by the committed expected outputs, and survives an
oracle that runs the engine; a sampler bug shared by plain decoding and verification is killed
by the oracle's own sampling law, and survives a law shaped by the engine's sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import cli
from conformance.backends.mutants import source_patches as sm
from conformance.plan.registry import BackendError, load_backend
from conformance.plan.run_plan import RunPlan
from conformance.run.suite import SuiteOptions, suite_args, suite_dir

TESTS = Path(__file__).resolve().parent
MUTANT = sm.SOURCE_MUTANTS["greedy_argmax_bf16"]
STALE = sm.SourceMutant("stale_patch", "An edit whose text is gone.",
                        (sm.SourceEdit("sampler.py", "no such line", "x"),))


def test_edits_apply_to_a_copy_and_mark_it(tmp_path: Path) -> None:
    with sm.patched_refengine(MUTANT) as root:
        sampler = (root / "refengine" / "sampler.py").read_text()
        assert MUTANT.edits[0].replace in sampler and MUTANT.edits[0].search not in sampler
        assert (root / "refengine" / sm.MARKER).read_text() == MUTANT.name
        assert (root / "fixtures" / "MANIFEST.json").exists()
    import refengine.sampler
    assert MUTANT.edits[0].search in Path(refengine.sampler.__file__).read_text()  # untouched


def test_a_patch_that_no_longer_applies_fails_with_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(sm.PatchError, match="occurs 0 times, expected once: 'no such line'"), \
            sm.patched_refengine(STALE):
        pass
    monkeypatch.setitem(sm.SOURCE_MUTANTS, STALE.name, STALE)
    assert cli.main(["mutants", "--only", STALE.name]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "source mutant stale_patch: refengine/sampler.py" in err, err


def test_an_unpatched_process_refuses_the_mutant() -> None:
    """In-process, the unpatched engine would be certified under the mutant's name."""
    with pytest.raises(BackendError, match="patches refengine's source"):
        load_backend(f"mutant:{MUTANT.name}")
    assert load_backend(f"mutant:{MUTANT.name}", launcher=True).name == f"mutant:{MUTANT.name}"


def test_the_subprocess_imports_the_patched_copy(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import refengine.sampler, inspect\n"
        "from conformance.plan.registry import load_backend\n"
        "def test_patched():\n"
        "    assert 'bfloat16' in inspect.getsource(refengine.sampler.select_tokens)\n"
        f"    assert load_backend('mutant:{MUTANT.name}').name == 'mutant:{MUTANT.name}'\n")
    done = sm.run_patched(MUTANT, [str(probe), "-q", "-p", "no:cacheprovider"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _tier(mutant: sm.SourceMutant, tier: str, tmp_path: Path, *extra: str
          ) -> dict[str, object]:
    """One tier of the suite in gate, against ``mutant``, in its patched subprocess."""
    tmp_path.mkdir()
    results = tmp_path / "results.json"
    opts = SuiteOptions(RunPlan(f"mutant:{mutant.name}", (mutant.spec,)))
    args = [str(suite_dir() / f"test_{tier}.py"), *suite_args(opts, results, None)[1:], *extra]
    done = sm.run_patched(mutant, args, python_path=(TESTS,))
    assert results.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(results.read_text())


def _failed(results: dict[str, object]) -> list[str]:
    checks = results["checks"]
    assert checks, "the lossless tier ran no check"
    return [c["nodeid"] for c in checks if c["outcome"] == "failed"]  # type: ignore[index]


@pytest.mark.slow
def test_committed_outputs_kill_what_a_live_oracle_cannot_see(tmp_path: Path) -> None:
    """The mutant's lossless tier: its oracle running the (patched) engine agrees with it
    everywhere; the committed outputs do not."""
    assert _failed(_tier(MUTANT, "lossless", tmp_path / "live", "-p", "expected_disabled")) == []
    assert _failed(_tier(MUTANT, "lossless", tmp_path / "committed"))


@pytest.mark.slow
def test_the_oracles_own_sampling_law_kills_a_shared_sampler_bug(tmp_path: Path) -> None:
    """A sampler that ignores top-p everywhere: held to a law shaped by that same sampler, the
    distribution tier's top-p checks find no small support and pass as not applicable; held to
    the oracle's own law, they fail."""
    mutant = sm.SOURCE_MUTANTS["sampler_ignores_top_p"]
    only = ("-k", "test_sampled_tokens_follow_target_distribution")
    shared = _tier(mutant, "distribution", tmp_path / "engine-law", "-p", "engine_sampling_law",
                   *only)
    assert _failed(shared) == []
    assert _failed(_tier(mutant, "distribution", tmp_path / "own-law", *only))
