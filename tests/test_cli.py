"""The `specgate` command: usage errors are one line and exit 2; certify writes the reports."""

from __future__ import annotations

import json
import shutil
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
    (["certify", "--spec", "eagle-v2"], ["not implemented", "eagle-v2"]),
    (["certify", "--model", "no-such-fixture"], ["unknown fixture", "no-such-fixture"]),
    (["certify", "--profile", "sometimes"], ["sometimes"]),
    (["certify", "-n", "many"], ["many"]),
    (["frobnicate"], ["frobnicate"]),
    ([], ["required"]),
    (["bench", "--batch-sizes", "1,x"], ["--batch-sizes"]),
    (["bench", "--spec", "warp"], ["unknown spec"]),
    (["bench", "--repeats", "0"], ["--repeats", "0"]),
    (["mutants", "--only", "nope"], ["unknown mutant", "nope"]),
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
    code, out, _ = run(capsys, "certify", "--model", str(random_model_dir), "-n", "0",
                       "--report", str(tmp_path))
    assert code == 0, out
    for name in ("report.md", "report.json", "junit.xml"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "passed"
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert {"lossless", "memory", "lifecycle", "kernel"} <= set(tiers)
    assert all(t["counts"]["failed"] == 0 for t in tiers.values())
    assert all(tiers[t]["counts"]["passed"] > 0 for t in ("lossless", "memory", "lifecycle"))
    assert "| lossless |" in out


def test_certify_fails_on_a_mutant(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                   tmp_path: Path) -> None:
    code, _, _ = run(capsys, "certify", "--backend", "mutant:ignores_stop_token_ids",
                     "--model", str(random_model_dir), "-n", "0", "--report", str(tmp_path))
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "failed"
    failed = [f["check"] for t in report["tiers"] for f in t["failures"]]
    assert any("test_stop_at_first_token" in f for f in failed), failed
