"""``specgate report merge``: shards joined into one certificate equal the unsharded one (check
set and verdicts); shards that do not belong together are refused with one line, exit 2,
nothing written; junit testcases and repro files carry over."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from conformance.contract import Capabilities
from conformance.report.certificate import build_certificate
from conformance.report.markdown import write_reports
from conformance.report.results import BackendIdentity, CheckRow, RunResults
from tests.test_cli import assert_usage_error, run

SELECTION = "test_max_new_tokens or test_stop"  # 6 quick lifecycle checks


def row(nodeid: str, outcome: str, seconds: float) -> CheckRow:
    """A check of tier ``a`` for ``test_a.py::...``; a failure left a repro file that
    reproduces it."""
    failed = outcome == "failed"
    return CheckRow(nodeid, nodeid.split(".py")[0].removeprefix("test_"), outcome, seconds,
                    "algorithm:none", "boom" if failed else "",
                    repro=f"repro/{nodeid.split('::')[1]}.json" if failed else None,
                    repro_reproduces=True if failed else None)


def results(spec: str, checks: list[tuple[str, str, float]], **extra: object) -> RunResults:
    """A plain-decoding run of backend ``b``; ``extra``: RunResults fields to change."""
    made = RunResults(BackendIdentity("b", "1", "pkg:b"), Capabilities(), spec, "gate",
                      tuple(row(*c) for c in checks), specgate_version="9.9")
    return replace(made, **extra)


def cert_dir(where: Path, spec: str, checks: list[tuple[str, str, float]], **extra: object
             ) -> Path:
    """A certificate directory as certify writes one, from synthetic results."""
    res = results(spec, checks, **extra)
    write_reports(build_certificate(res), where)
    suite = ET.Element("testsuite", name="pytest")
    for nodeid, outcome, seconds in checks:
        module, name = nodeid.split("::")
        case = ET.SubElement(suite, "testcase", classname=module.removesuffix(".py"), name=name,
                             time=str(seconds))
        if outcome == "failed":
            ET.SubElement(case, "failure", message="boom")
            (where / "repro").mkdir(exist_ok=True)
            (where / "repro" / f"{name}.json").write_text("{}")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(where / "junit.xml")
    return where


A = [("test_a.py::one", "passed", 3.0), ("test_a.py::two", "failed", 1.0)]
B = [("test_b.py::three", "passed", 2.0), ("test_b.py::four", "not claimed", 0.0)]


def verdicts(report: Path) -> dict[str, str]:
    return {c["nodeid"]: c["outcome"] for c in json.loads(report.read_text())["checks"]}


def test_merge_joins_shards(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    one = cert_dir(tmp_path / "s1", "none", A, shard="1/2")
    two = cert_dir(tmp_path / "s2", "none", B, shard="2/2")
    code, out, _ = run(capsys, "report", "merge", str(two), str(one), "--out",
                       str(tmp_path / "m"))
    assert code == 1  # a shard's failure fails the merged certificate
    merged = json.loads((tmp_path / "m" / "report.json").read_text())
    assert verdicts(tmp_path / "m" / "report.json") == {n: o for n, o, _ in A + B}
    assert merged["shard"] == "merged from 2 shards" and merged["specgate_version"] == "9.9"
    assert merged["status"] == "failed" and merged["vacuous"] is None
    cases = ET.parse(tmp_path / "m" / "junit.xml").getroot().find("testsuite")
    assert cases is not None and cases.get("tests") == "4" and cases.get("failures") == "1"
    assert (tmp_path / "m" / "repro" / "two.json").exists()
    md = (tmp_path / "m" / "report.md").read_text()
    assert f"replay: `specgate repro {tmp_path / 'm' / 'repro' / 'two.json'} --backend pkg:b`" in md
    assert f"replay: specgate repro {tmp_path / 'm' / 'repro' / 'two.json'}" in out


def test_merge_of_multi_spec_shards(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for shard, checks in (("1/2", A), ("2/2", B)):
        for spec in ("none", "eagle"):
            cert_dir(tmp_path / shard[0] / spec, spec, checks, shard=shard)
        (tmp_path / shard[0] / "summary.md").write_text("x")
    code, _, _ = run(capsys, "report", "merge", str(tmp_path / "1"), str(tmp_path / "2"),
                     "--out", str(tmp_path / "m"))
    assert code == 1
    for spec in ("none", "eagle"):
        assert verdicts(tmp_path / "m" / spec / "report.json") == {n: o for n, o, _ in A + B}
    summary = (tmp_path / "m" / "summary.md").read_text()
    assert summary.index("| none | FAILED |") < summary.index("| eagle | FAILED |")  # --spec order


def test_a_spec_the_selection_misses_in_every_shard_gets_no_certificate(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for shard, checks in (("1/2", A), ("2/2", B)):
        cert_dir(tmp_path / shard[0] / "none", "none", checks, shard=shard, selection="-k 'x'")
        cert_dir(tmp_path / shard[0] / "eagle", "eagle", [], shard=shard, selection="-k 'x'",
                 vacuous="zero checks collected")
    code, _, err = run(capsys, "report", "merge", str(tmp_path / "1"), str(tmp_path / "2"),
                       "--out", str(tmp_path / "m"))
    assert code == 1 and "spec eagle: no check matches -k 'x'" in err
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["none", "summary.md"]
    assert "checks selected by `-k 'x'`" in (tmp_path / "m" / "none" / "report.md").read_text()


def test_multi_spec_shards_must_hold_the_same_specs(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    cert_dir(tmp_path / "1" / "none", "none", A, shard="1/2")
    cert_dir(tmp_path / "2" / "none", "none", B, shard="2/2")
    cert_dir(tmp_path / "2" / "eagle", "eagle", B, shard="2/2")
    code, _, err = run(capsys, "report", "merge", str(tmp_path / "1"), str(tmp_path / "2"),
                       "--out", str(tmp_path / "m"))
    assert_usage_error(code, err, "shards of different specs", "eagle, none")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("change, needle", [
    ({"specgate_version": "1.0"}, "different specgate versions"),
    ({"backend": BackendIdentity("c", "1", "pkg:c")}, "different backends"),
    ({"spec": "eagle"}, "different specs"),
    ({"shard": "2/3"}, "different shard counts"),
    ({"shard": "1/2"}, "shards 1, 1 of 2"),
    ({"shard": None}, "some of the certificates are shards"),
    ({"checks": A}, "overlapping shards: test_a.py::one"),
    ({"selection": "-k 'x'"}, "different selections"),
    ({"device": "cuda"}, "different devices"),
])
def test_shards_that_do_not_belong_together_are_refused(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, change: dict[str, object],
        needle: str) -> None:
    cert_dir(tmp_path / "s1", "none", A, shard="1/2")
    second = {"spec": "none", "checks": B, "shard": "2/2", **change}
    spec, checks = second.pop("spec"), second.pop("checks")
    cert_dir(tmp_path / "s2", spec, checks, **second)  # type: ignore[arg-type]
    code, _, err = run(capsys, "report", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"),
                       "--out", str(tmp_path / "m"))
    assert_usage_error(code, err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1", "s2"]


def test_a_missing_shard_and_a_directory_that_is_no_certificate(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cert_dir(tmp_path / "s1", "none", A, shard="1/2")
    code, _, err = run(capsys, "report", "merge", str(tmp_path / "s1"), "--out",
                       str(tmp_path / "m"))
    assert_usage_error(code, err, "shards 1 of 2 given")
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "report", "merge", str(tmp_path / "empty"), "--out",
                       str(tmp_path / "m"))
    assert_usage_error(code, err, "holds no report.json")
    assert not (tmp_path / "m").exists()


def test_shards_merged_equal_the_unsharded_certificate(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path) -> None:
    """The real thing, on a quick selection: shards 1/2 and 2/2, merged, hold exactly the
    unsharded run's checks with the same verdicts, and neither shard is empty."""
    common = ["certify", "--spec", "none", "--backend", "mutant:ignores_stop_token_ids",
              "--model", str(random_model_dir), "-n", "0", "-k", SELECTION]
    assert run(capsys, *common, "--report", str(tmp_path / "whole"))[0] == 1
    shards = []
    for i in (1, 2):
        run(capsys, *common, "--shard", f"{i}/2", "--report", str(tmp_path / f"s{i}"))
        shards.append(verdicts(tmp_path / f"s{i}" / "report.json"))
    assert all(shards) and not set(shards[0]) & set(shards[1])
    code, _, _ = run(capsys, "report", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"),
                     "--out", str(tmp_path / "merged"))
    whole = verdicts(tmp_path / "whole" / "report.json")
    assert code == 1 and len(whole) == 6 and "failed" in whole.values()
    assert verdicts(tmp_path / "merged" / "report.json") == whole
    cases = ET.parse(tmp_path / "merged" / "junit.xml").getroot().find("testsuite")
    assert cases is not None and cases.get("tests") == "6"
    assert cases.get("failures") == str(list(whole.values()).count("failed"))
