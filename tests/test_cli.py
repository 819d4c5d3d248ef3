"""The `specgate` command: usage errors are one line and exit 2; certify writes the reports."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conformance.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specgate: error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("argv, needles", [
    (["certify", "--backend", "no-such-backend"], ["unknown backend", "no-such-backend"]),
    (["certify", "--backend", "nomodule_xyz:factory"], ["cannot import", "nomodule_xyz"]),
    (["certify", "--backend", "mutant:nope"], ["unknown mutant", "nope"]),
    (["certify", "--spec", "warp"], ["unknown spec", "warp"]),
    (["certify", "--model", "no-such-fixture"], ["unknown fixture", "no-such-fixture"]),
    (["certify", "--profile", "sometimes"], ["sometimes"]),
    (["certify", "-n", "many"], ["many"]),
    (["frobnicate"], ["frobnicate"]),
    ([], ["required"]),
    (["bench", "--batch-sizes", "1,x"], ["--batch-sizes"]),
    (["bench", "--spec", "warp"], ["unknown spec"]),
    (["bench", "--repeats", "0"], ["--repeats", "0"]),
    (["mutants", "--only", "nope"], ["unknown mutant", "nope"]),
    (["golden", "check", "--spec", "eagle-v2"], ["no acceptance traces of its own"]),
])
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                   needles: list[str], random_model_dir: Path) -> None:
    if "--model" not in argv and argv and argv[0] in ("certify", "bench", "mutants"):
        argv = [*argv, "--model", str(random_model_dir)]
    code, _, err = run(capsys, *argv)
    assert_usage_error(code, err, *needles)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_model_dir_missing_file_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                 random_model_dir: Path, tmp_path: Path,
                                                 missing: str) -> None:
    broken = tmp_path / "model"
    shutil.copytree(random_model_dir, broken)
    (broken / missing).unlink()
    # Loading happens inside the suite; certify checks the directory up front.
    code, _, err = run(capsys, "certify", "--model", str(broken), "-n", "0",
                       "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, missing)


def test_certify_writes_three_reports(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                      tmp_path: Path) -> None:
    code, out, _ = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       "-n", "0", "--report", str(tmp_path))
    assert code == 0, out
    for name in ("report.md", "report.json", "junit.xml"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "passed"
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert {"lossless", "memory", "lifecycle", "kernel"} <= set(tiers)
    assert all(t["counts"]["failed"] == 0 for t in tiers.values())
    assert all(tiers[t]["counts"]["passed"] > 0 for t in ("lossless", "memory", "lifecycle"))
    assert "spec none: PASSED" in out and "lossless" in out
    report_md = (tmp_path / "report.md").read_text()
    # a tier that did not run says why, in the report itself
    assert "## Checks that did not run, and why" in report_md
    assert "| worker | 6 | skipped: plain decoding has no speculative worker |" in report_md
    assert len((tmp_path / "junit.xml").read_text().splitlines()) > 10  # indented, not one line


def test_certify_fails_on_a_mutant(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                   tmp_path: Path) -> None:
    code, _, _ = run(capsys, "certify", "--backend", "mutant:ignores_stop_token_ids",
                     "--spec", "none", "--model", str(random_model_dir), "-n", "0",
                     "--report", str(tmp_path))
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "failed"
    failed = [f["check"] for t in report["tiers"] for f in t["failures"]]
    assert any("test_stop_at_first_token" in f for f in failed), failed


# --- bad paths: one line, exit 2, before any work, nothing half-written -------------------------

def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("specgate ")


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["certify", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: specgate-report)" in out and "(default: gate)" in out


def _no_work_done(tmp_path: Path, before: set[str]) -> None:
    """Nothing was written beside the inputs: no report, no staging directory."""
    assert {p.name for p in tmp_path.iterdir()} == before


def test_report_path_that_is_a_file(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                    tmp_path: Path) -> None:
    target = tmp_path / "report"
    target.write_text("not a directory")
    code, _, err = run(capsys, "certify", "--model", str(random_model_dir), "--report",
                       str(target))
    assert_usage_error(code, err, "--report", "not a directory")
    assert target.read_text() == "not a directory"
    _no_work_done(tmp_path, {"report"})


def test_report_path_under_a_file_is_unwritable(capsys: pytest.CaptureFixture[str],
                                                random_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "certify", "--model", str(random_model_dir), "--report",
                       str(tmp_path / "file" / "report"))
    assert_usage_error(code, err, "--report", "cannot write there")
    _no_work_done(tmp_path, {"file"})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_report_in_a_read_only_directory(capsys: pytest.CaptureFixture[str],
                                         random_model_dir: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, _, err = run(capsys, "certify", "--model", str(random_model_dir), "--report",
                       str(locked / "report"))
    assert_usage_error(code, err, "--report", "cannot write there")


def test_report_dir_with_someone_elses_files_is_refused(capsys: pytest.CaptureFixture[str],
                                                        random_model_dir: Path,
                                                        tmp_path: Path) -> None:
    """The report directory is replaced as a whole, so one holding other files is refused."""
    (tmp_path / "report.md").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "certify", "--model", str(random_model_dir), "--report",
                       str(tmp_path))
    assert_usage_error(code, err, "--report", "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    _no_work_done(tmp_path, {"report.md", "notes.txt"})


def test_a_new_report_replaces_the_old_one_whole(capsys: pytest.CaptureFixture[str],
                                                 random_model_dir: Path, tmp_path: Path) -> None:
    """An older report.md (and a spec directory of an earlier `--spec all` run) never survives
    beside newer files."""
    report = tmp_path / "report"
    (report / "eagle").mkdir(parents=True)
    (report / "report.md").write_text("result: **PASSED** (an old run)")
    (report / "eagle" / "report.md").write_text("old")
    code, _, _ = run(capsys, "certify", "--backend", "mutant:ignores_stop_token_ids",
                     "--spec", "none", "--model", str(random_model_dir), "-n", "0",
                     "--report", str(report))
    assert code == 1
    assert sorted(p.name for p in report.iterdir()) == ["junit.xml", "report.json", "report.md",
                                                        "repro"]
    assert list((report / "repro").glob("*.json"))  # the failing checks' scenarios
    assert "FAILED" in (report / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no staging left


def test_bench_json_into_a_missing_directory_is_created(capsys: pytest.CaptureFixture[str],
                                                        random_model_dir: Path,
                                                        tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "bench.json"
    code, out, _ = run(capsys, "bench", "--model", str(random_model_dir), "--backends",
                       "refengine", "--batch-sizes", "1", "--max-new-tokens", "2",
                       "--min-requests", "1", "--graphs", "none", "--json", str(target))
    assert code == 0, out
    assert json.loads(target.read_text())["rows"][0]["batch_size"] == 1


@pytest.mark.parametrize("where, needle", [("dir", "is a directory"),
                                           ("under-file", "cannot write there")])
def test_bench_json_bad_path_is_refused_before_the_bench(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, where: str, needle: str) -> None:
    import conformance.bench.measure

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bench ran before its --json path was checked")

    monkeypatch.setattr(conformance.bench.measure, "run_bench", must_not_run)
    (tmp_path / "file").write_text("x")
    target = tmp_path if where == "dir" else tmp_path / "file" / "bench.json"
    code, _, err = run(capsys, "bench", "--model", str(random_model_dir), "--json", str(target))
    assert_usage_error(code, err, "--json", needle)


def test_golden_unknown_prompt_set(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "golden", "check", "--prompt-set", "nope")
    assert_usage_error(code, err, "unknown prompt set", "nope")


def test_graph_executor_choices_are_the_engines() -> None:
    from conformance import cli
    from refengine.config import GRAPH_EXECUTORS

    subcommands = next(a for a in cli.build_parser()._actions
                       if isinstance(a, argparse._SubParsersAction))
    for command in ("certify", "bench"):
        graphs = next(a for a in subcommands.choices[command]._actions if a.dest == "graphs")
        assert tuple(graphs.choices) == (*GRAPH_EXECUTORS, "auto", "none"), command
        assert graphs.const == "auto", command


@pytest.mark.parametrize(("asked", "device", "executor"), [
    ("auto", "cpu", "aot"), ("auto", "cuda", "cuda"), ("none", "cpu", None),
    (None, "cpu", None), ("replay", "cpu", "replay")])
def test_graphs_auto_is_the_devices_fastest_executor(asked: str | None, device: str,
                                                     executor: str | None) -> None:
    from conformance.plan.device import best_graphs

    assert best_graphs(asked, device) == executor


def test_bench_runs_graph_lanes_by_default_and_none_turns_them_off() -> None:
    from conformance import cli

    parse = cli.build_parser().parse_args
    assert parse(["bench"]).graphs == "auto"
    assert parse(["bench", "--graphs", "none"]).graphs == "none"
    assert parse(["certify"]).graphs is None and parse(["certify", "--graphs"]).graphs == "auto"


@pytest.mark.parametrize("command", ["certify", "bench"])
def test_graphs_need_a_backend_that_claims_a_graph_runner(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, command: str) -> None:
    backend = ["--backend", "hf"] if command == "certify" else ["--backends", "hf"]
    code, _, err = run(capsys, command, *backend, "--model", str(random_model_dir),
                       "--graphs", "replay")
    assert_usage_error(code, err, "--graphs", "graph_runner")


def test_hf_backend_without_transformers_names_the_extra(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "conformance.backends.hf", raising=False)
    code, _, err = run(capsys, "certify", "--backend", "hf", "--model", str(random_model_dir))
    assert_usage_error(code, err, "specgate[hf]")


def test_mutants_list_names_class_spec_and_killer_without_running(
        capsys: pytest.CaptureFixture[str]) -> None:
    from conformance.backends.mutants import MUTANTS
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS

    code, out, _ = run(capsys, "mutants", "--list", "--json")
    assert code == 0
    rows = {r["mutant"]: r for r in json.loads(out)}
    assert set(rows) == {*MUTANTS, *SOURCE_MUTANTS}
    leak = rows["leak_on_finish"]
    assert leak["spec"] == "none" and leak["bug_class"].startswith("KV slots leak")
    assert leak["meant_for"] == "test_memory.py::test_invariants_under_pressure[plain-1]"
    assert leak["command"] == "specgate certify --backend mutant:leak_on_finish --spec none"
    code, out, _ = run(capsys, "mutants", "--list", "--only", "leak_on_finish")
    assert code == 0 and "[plain-1]" in out  # a node id's brackets are text, not markup
    code, _, err = run(capsys, "mutants", "--list", "--only", "no_such")
    assert_usage_error(code, err, "unknown mutant(s) ['no_such']")
