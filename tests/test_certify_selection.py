"""What ``specgate certify`` runs: ``--only`` node ids and ``-k``, a bare certify certifying
every spec the backend claims, and each failure shown with the command that replays it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.backends.refengine import RefEngineBackend
from conformance.backends.refengine.adapter import RefEngineHandle
from conformance.contract import Capabilities, OpenConfig
from conformance.plan.run_plan import RunPlan, claimed_specs
from conformance.plan.specs import SPECS
from conformance.plan.usage import UsageError
from conformance.report.certificate import build_certificate
from conformance.report.markdown import render_markdown
from conformance.report.report_dir import ReportDir, ReportDirError
from conformance.report.results import RunResults
from conformance.repro.record import TIMED_OUT
from conformance.run.only import parse_only
from conformance.run.suite import SuiteOptions, SuiteRun, suite_args, suite_dir
from tests.test_cli import assert_usage_error, run
from tests.test_merge import results

STOP = "test_lifecycle.py::test_stop_at_first_token"
MAX1 = "test_lifecycle.py::test_max_new_tokens[1]"


class PlainOnly(RefEngineBackend):
    """The reference engine claiming plain decoding alone."""

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), algorithms=frozenset({"none"}))


def plain_only() -> PlainOnly:
    return PlainOnly()


class NoSpec(RefEngineBackend):
    """The reference engine claiming no algorithm at all."""

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), algorithms=frozenset())


def no_spec() -> NoSpec:
    return NoSpec()


def test_claimed_specs() -> None:
    assert claimed_specs(RefEngineBackend().capabilities()) == list(SPECS.values())
    assert [s.name for s in claimed_specs(PlainOnly().capabilities())] == ["none"]
    no_tree = replace(RefEngineBackend().capabilities(), tree=False)
    assert [s.name for s in claimed_specs(no_tree)] == ["none", "eagle", "eagle3", "draft-model",
                                                       "ngram"]
    chain = replace(no_tree, algorithms=frozenset({"eagle"}))
    assert [s.name for s in claimed_specs(chain)] == ["eagle"]


def test_a_backend_that_claims_no_spec_is_a_usage_error(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "certify", "--backend", "tests.test_certify_selection:no_spec",
                       "--model", str(random_model_dir), "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "--spec claimed", "claims no spec")
    assert list(tmp_path.iterdir()) == []


class RefusesModel(RefEngineBackend):
    """The reference engine refusing every model at open, as vLLM refuses an architecture it
    does not know."""

    def open(self, cfg: OpenConfig) -> RefEngineHandle:
        raise ValueError(f"model: RefusesModel cannot load {cfg.model}: no such architecture\n"
                         "second line")


def refuses_model() -> RefusesModel:
    return RefusesModel()


def test_a_model_the_backend_refuses_is_a_usage_error(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path) -> None:
    """Refused once, before any check, rather than every check failing with the same line."""
    code, _, err = run(capsys, "certify", "--backend",
                       "tests.test_certify_selection:refuses_model", "--spec", "none",
                       "--model", str(random_model_dir), "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, f"--model {random_model_dir}", "refuses it",
                       "no such architecture")
    assert "second line" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_backend_open_that_crashes_is_left_to_the_checks(
        monkeypatch: pytest.MonkeyPatch, random_model_dir: Path) -> None:
    """Only ``ValueError`` is the contract's refusal: any other error at open is a backend bug
    the suite's checks report, so the probe neither hides nor reports it."""
    from conformance.contract import OpenConfig as Cfg
    from conformance.plan.preflight import refuses_model as probe

    opened: list[Cfg] = []

    class Crashes(RefEngineBackend):
        def open(self, cfg: Cfg) -> RefEngineHandle:
            opened.append(cfg)
            raise RuntimeError("segfault-like")

    probe(Crashes(), Cfg(model=str(random_model_dir)))
    assert [c.model for c in opened] == [str(random_model_dir)]
    with pytest.raises(UsageError, match="refuses it"):
        probe(RefusesModel(), Cfg(model=str(random_model_dir)))
    handle_closed: list[bool] = []

    class Accepts(RefEngineBackend):
        def open(self, cfg: Cfg) -> RefEngineHandle:
            handle = super().open(cfg)
            original = handle.close
            handle.close = lambda: (handle_closed.append(True), original())[1]  # type: ignore[method-assign]
            return handle

    probe(Accepts(), Cfg(model=str(random_model_dir)))
    assert handle_closed == [True]


@pytest.mark.parametrize("backend, specs", [
    ("refengine", list(SPECS)), ("tests.test_certify_selection:plain_only", ["none"])])
def test_a_bare_certify_certifies_every_claimed_spec(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        random_model_dir: Path, tmp_path: Path, backend: str, specs: list[str]) -> None:
    import conformance.run.suite

    ran: list[str] = []

    def fake_run(opts: SuiteOptions, *args: object, **kwargs: object) -> SuiteRun:
        (spec,) = opts.plan.specs
        ran.append(spec)
        return SuiteRun(0, results(spec, [("test_a.py::x", "passed", 1.0)]), False)

    monkeypatch.setattr(conformance.run.suite, "run_suite", fake_run)
    code, _, err = run(capsys, "certify", "--backend", backend, "--model",
                         str(random_model_dir), "--report", str(tmp_path / "r"))
    assert code == 0, err
    assert ran == specs and f"the backend claims {', '.join(specs)}" in err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([*specs, "summary.md"])


def test_parse_only() -> None:
    ids = parse_only([f"{STOP},{MAX1}", "test_lossless.py::f[a,b],test_memory.py::g"],
                     suite_dir())
    assert ids == [STOP, MAX1, "test_lossless.py::f[a,b]", "test_memory.py::g"]
    with pytest.raises(ValueError, match=r"'tests/test_x\.py' is not a suite module"):
        parse_only(["tests/test_x.py::f"], suite_dir())


def test_only_runs_the_suite_modules_it_names(tmp_path: Path) -> None:
    opts = SuiteOptions(RunPlan("refengine", ("none",), only=(STOP, MAX1), keyword="x"),
                        repro_dir=str(tmp_path))
    args = suite_args(opts, tmp_path / "r.json", None)
    assert args[:2] == [str(suite_dir() / "test_lifecycle.py"), "-c"]  # not the whole suite
    assert args.count("--specgate-only") == 2 and args[args.index("-k") + 1] == "x"
    assert args[args.index("--specgate-repro-dir") + 1] == str(tmp_path)


@pytest.mark.parametrize("argv, needles", [
    (["--only", "test_nope.py::f"], ["--only", "not a suite module"]),
    (["--only", STOP, "--shard", "1/2"], ["--only and --shard"]),
])
def test_bad_selections_are_usage_errors(capsys: pytest.CaptureFixture[str],
                                         random_model_dir: Path, tmp_path: Path,
                                         argv: list[str], needles: list[str]) -> None:
    code, _, err = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       *argv, "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


def test_only_reruns_single_checks(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                   tmp_path: Path) -> None:
    common = ["certify", "--spec", "none", "--model", str(random_model_dir), "-n", "0"]
    code, _, err = run(capsys, *common, "--only", f"{STOP},{MAX1}", "--only",
                       "test_lifecycle.py::no_such", "--report", str(tmp_path / "r"))
    assert code == 0, err
    checks = json.loads((tmp_path / "r" / "report.json").read_text())["checks"]
    assert sorted(c["nodeid"] for c in checks) == sorted([STOP, MAX1])
    assert "warning: --only test_lifecycle.py::no_such: matches no check of this run" in err
    code, _, _ = run(capsys, *common, "--only", "test_lifecycle.py::no_such", "--report",
                     str(tmp_path / "none"))
    report = json.loads((tmp_path / "none" / "report.json").read_text())
    assert code == 1 and report["vacuous"] == ("zero checks collected: no check matches "
                                               "--only test_lifecycle.py::no_such")


def with_check(res: RunResults, at: int = 0, **change: object) -> RunResults:
    """``res`` with its check number ``at`` changed."""
    checks = list(res.checks)
    checks[at] = replace(checks[at], **change)
    return replace(res, checks=tuple(checks))


def test_a_failure_shows_the_command_that_replays_it(tmp_path: Path) -> None:
    res = results("none", [("test_a.py::two", "failed", 1.0), ("test_a.py::one", "failed", 1.0)])
    res = with_check(res, repro=None, repro_reproduces=None, at=1)
    md = render_markdown(build_certificate(res), tmp_path / "my report")
    quoted = f"'{tmp_path}/my report/repro/two.json'"
    rerun = "specgate certify --backend pkg:b --spec none --only"
    assert (f"- `test_a.py::two`: boom\n  - rerun: `{rerun} test_a.py::two`\n"
            f"  - replay: `specgate repro {quoted} --backend pkg:b`") in md
    # no repro file: the rerun alone
    assert f"- `test_a.py::one`: boom\n  - rerun: `{rerun} test_a.py::one`\n\n" in md


def test_the_rerun_line_carries_every_option_that_changes_the_check() -> None:
    """Left out where certify's default; quoted where a shell would split or expand."""
    from conformance.report.failures import Rerun

    check = "test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-4]"
    assert Rerun("refengine", "eagle").command(check) == (
        f"specgate certify --backend refengine --spec eagle --only '{check}'")
    full = Rerun("mod.x:factory", "eagle", "full", "/tmp/my model", "tiny-code-eagle-vllm",
                 "replay", "cuda:1")
    assert full.command(check) == (
        "specgate certify --backend mod.x:factory --spec eagle --profile full --model "
        "'/tmp/my model' --draft-model tiny-code-eagle-vllm --graphs replay --device cuda:1 "
        f"--only '{check}'")


def test_a_repro_that_does_not_reproduce_offers_no_command(tmp_path: Path) -> None:
    """A check that failed on its own assertion left a scenario that replays clean: the
    certificate names the file and says so, and offers no replay command."""
    res = results("none", [("test_a.py::two", "failed", 1.0)])
    res = with_check(res, repro_reproduces=False)
    md = render_markdown(build_certificate(res), tmp_path)
    assert "specgate repro" not in md
    assert f"repro file `{tmp_path}/repro/two.json`: its scenario replays clean" in md


@pytest.mark.parametrize("why", [
    TIMED_OUT, "backend 'b' does not claim abort, which the scenario needs"])
def test_an_unreplayed_repro_says_why_not(tmp_path: Path, why: str) -> None:
    """The check timed out, or the backend refuses the replay: reproduction is unknown; the
    certificate says why and never that the scenario replays clean."""
    res = results("none", [("test_a.py::two", "failed", 1.0)])
    res = with_check(res, repro_reproduces=None, repro_not_replayed=why)
    md = render_markdown(build_certificate(res), tmp_path)
    assert "specgate repro" in md and f"(not replayed: {why})" in md, md
    assert "replays clean" not in md


def test_a_report_dir_may_hold_repro_files(tmp_path: Path) -> None:
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "test_a.py__x.json").write_text("{}")
    (tmp_path / "eagle" / "repro").mkdir(parents=True)
    (tmp_path / "eagle" / "repro" / "y.json").write_text("{}")
    ReportDir(tmp_path).discard()
    (tmp_path / "repro" / "notes.txt").write_text("mine")
    with pytest.raises(ReportDirError, match=r"repro/notes\.txt"):
        ReportDir(tmp_path)


def test_under_every_spec_only_runs_the_ids_each_spec_has(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        random_model_dir: Path, tmp_path: Path) -> None:
    """A spec where none of the ids is a check gets no certificate (and says so)."""
    import conformance.run.suite

    chain = "test_lossless.py::test_greedy_matches_reference[chain-s3-n4-batch-1]"

    def fake_run(opts: SuiteOptions, *args: object, **kwargs: object) -> SuiteRun:
        assert opts.plan.only == (chain,)
        has = opts.plan.specs[0] == "eagle"
        res = results(opts.plan.specs[0], [(chain, "passed", 1.0)] if has else [],
                      vacuous=None if has else "zero checks collected")
        return SuiteRun(0 if has else 1, res, False)

    monkeypatch.setattr(conformance.run.suite, "run_suite", fake_run)
    code, _, err = run(capsys, "certify", "--spec", "all", "--only", chain, "--model",
                       str(random_model_dir), "--report", str(tmp_path / "r"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["eagle", "summary.md"]
    assert f"spec none: no check matches --only {chain}" in err
    assert "warning" not in err


def test_a_shard_keeps_every_spec(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, random_model_dir: Path,
                                  tmp_path: Path) -> None:
    """A shard keeps the (vacuous) certificate of a spec it got no check of, so that every
    shard holds every spec and the merge decides over the union."""
    import conformance.run.suite

    def fake_run(opts: SuiteOptions, *args: object, **kwargs: object) -> SuiteRun:
        assert (opts.plan.shard, opts.plan.keyword) == ("2/2", "stop")
        (spec,) = opts.plan.specs
        return SuiteRun(1, results(spec, [], vacuous="zero checks collected"), False)

    monkeypatch.setattr(conformance.run.suite, "run_suite", fake_run)
    code, _, _ = run(capsys, "certify", "--spec", "all", "-k", "stop", "--shard", "2/2",
                     "--model", str(random_model_dir), "--report", str(tmp_path / "r"))
    assert code == 1
    report = json.loads((tmp_path / "r" / "eagle" / "report.json").read_text())
    assert (report["shard"], report["selection"]) == ("2/2", "-k 'stop'")
    assert report["vacuous"] == "zero checks collected: no check matches -k 'stop', --shard 2/2"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([*SPECS, "summary.md"])
