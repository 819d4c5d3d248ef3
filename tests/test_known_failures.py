"""``--known-failures FILE``: listed failures are known (not passed, not failing the gate), a
listed check that passes is stale (failing the gate under ``--strict-known``), an expired entry
excuses nothing, an id that matches no check is warned about; the certificate lists them all,
each known failure with its message and replay commands; a bad file (a misspelt spec, an id of
no suite check, a missing repro file) is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from datetime import date
from pathlib import Path

import pytest

from conformance.report.certificate import build_certificate
from conformance.report.failures import Rerun, console_lines
from conformance.report.junit import mark_known
from conformance.report.markdown import render_markdown
from conformance.report.results import KnownReport, RunResults
from conformance.report.results_json import jsonable
from conformance.run.known_failures import KnownFailure, apply_known, load_known
from tests.test_cli import assert_usage_error, run
from tests.test_merge import results

TODAY = date(2026, 6, 1)
CHECKS = [("test_a.py::fails", "failed", 1.0), ("test_a.py::passes", "passed", 1.0),
          ("test_a.py::old", "failed", 1.0), ("test_a.py::gated", "not claimed", 0.0)]
ENTRIES = [KnownFailure("test_a.py::fails", "tracked in #1", date(2026, 12, 31)),
           KnownFailure("test_a.py::passes", "fixed upstream?"),
           KnownFailure("test_a.py::old", "was flaky", date(2026, 5, 31)),
           KnownFailure("test_a.py::gated", "needs trees"),
           KnownFailure("test_a.py::gone", "renamed"),
           KnownFailure("test_a.py::passes", "other spec only", spec="eagle")]
SUITES = Path(__file__).resolve().parent.parent / "conformance" / "suites"


def applied(strict: bool = False) -> RunResults:
    return apply_known(results("none", CHECKS), ENTRIES, "kf.toml", strict, TODAY)


def report_of(done: RunResults) -> KnownReport:
    assert done.known_failures is not None
    return done.known_failures


def test_each_entry_is_known_stale_expired_not_run_or_unknown() -> None:
    done = applied()
    outcomes = {c.nodeid: c.outcome for c in done.checks}
    assert outcomes == {"test_a.py::fails": "known failure", "test_a.py::passes": "passed",
                        "test_a.py::old": "failed", "test_a.py::gated": "not claimed"}
    known = report_of(done)
    assert [[i.check for i in known.kind(k)] for k in
            ("known", "stale", "expired", "not_run", "unknown")] == [
        ["test_a.py::fails"], ["test_a.py::passes"], ["test_a.py::old"], ["test_a.py::gated"],
        ["test_a.py::gone"]]


def test_a_known_failure_does_not_fail_the_gate_an_expired_one_does() -> None:
    cert = build_certificate(applied())
    assert cert.status == "failed"  # test_a.py::old expired: its failure counts again
    fresh = [e for e in ENTRIES if e.check != "test_a.py::old"]
    checks = [c for c in CHECKS if c[0] != "test_a.py::old"]
    ok = build_certificate(apply_known(results("none", checks), fresh, "kf.toml", False, TODAY))
    assert ok.status == "passed"
    tier = ok.tiers[0]
    assert tier.counts["known failure"] == 1 and tier.counts["passed"] == 1 and not tier.failures
    strict = build_certificate(apply_known(results("none", checks), fresh, "kf.toml", True,
                                           TODAY))
    assert strict.status == "failed"  # the stale entry, under --strict-known
    assert "PASSED (1 known failure(s), 1 stale)" in render_markdown(ok)


def test_only_known_failures_is_no_pass() -> None:
    done = apply_known(results("none", CHECKS[:1]), ENTRIES, "kf.toml", False, TODAY)
    cert = build_certificate(done)
    assert cert.status == "failed" and "known failure" in str(cert.vacuous)


def test_the_certificate_lists_them_all() -> None:
    md = render_markdown(build_certificate(applied()))
    section = md.split("## Known failures")[1]
    for needle in ("From `kf.toml`", "**known failure: 1**", "`test_a.py::fails`: tracked in "
                   "#1, until 2026-12-31", "**stale: 1**", "`test_a.py::passes`: fixed upstream?",
                   "**expired: 1**", "`test_a.py::old`: was flaky, until 2026-05-31 (outcome: "
                   "failed)", "**listed, did not run: 1**", "**listed, no such check: 1**",
                   "`test_a.py::gone`: renamed"):
        assert needle in section, needle
    lines = console_lines([], Rerun("b", "none"), applied().known_failures, Path("r"))
    assert "  stale: test_a.py::passes: fixed upstream?" in lines
    assert "  listed, no such check: test_a.py::gone: renamed" in lines


def test_a_known_failure_shows_its_message_and_replays(tmp_path: Path) -> None:
    """Beside each known failure: the check's failure message, the replay of the repro file the
    run wrote, and the one the entry names; in report.md, report.json and on the console."""
    listed = tmp_path / "repros" / "fails.json"
    listed.parent.mkdir()
    listed.write_text("{}")
    entry = KnownFailure("test_a.py::fails", "tracked in #1", repro=str(listed))
    done = apply_known(results("none", CHECKS[:2]), [entry], "kf.toml", False, TODAY)
    (known,) = report_of(done).known
    item = jsonable(known)
    assert item == {"check": "test_a.py::fails", "reason": "tracked in #1",
                    "outcome": "failed", "expires": None, "message": "boom",
                    "repro": "repro/fails.json", "repro_reproduces": "yes",
                    "listed_repro": str(listed)}
    cert = build_certificate(done)
    section = render_markdown(cert, Path("out")).split("## Known failures")[1]
    for needle in ("- `test_a.py::fails`: tracked in #1", "  - message: boom",
                   "  - replay: `specgate repro out/repro/fails.json --backend pkg:b`",
                   f"  - listed repro: `specgate repro {listed} --backend pkg:b`"):
        assert needle in section, needle
    assert json.loads(cert.to_json())["known_failures"]["known"] == [item]
    lines = console_lines([], Rerun("pkg:b", "none"), done.known_failures, Path("out"))
    assert lines == ["  known failure: test_a.py::fails: tracked in #1", "    message: boom",
                     "    replay: specgate repro out/repro/fails.json --backend pkg:b",
                     f"    listed repro: specgate repro {listed} --backend pkg:b"]


def test_a_known_failure_whose_repro_replays_clean_says_so() -> None:
    rows = results("none", CHECKS[:1])
    rows = replace(rows, checks=(replace(rows.checks[0], repro_reproduces=False),))
    done = apply_known(rows, ENTRIES[:1], "kf.toml", False, TODAY)
    lines = console_lines([], Rerun("b", "none"), done.known_failures, Path("r"))
    assert lines[-1].startswith("    repro file r/repro/fails.json: its scenario replays clean")


def test_known_failures_are_skipped_in_junit(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite tests="2" failures="2">'
                    '<testcase classname="test_a" name="fails"><failure message="x"/></testcase>'
                    '<testcase classname="test_a" name="old"><failure message="y"/></testcase>'
                    "</testsuite></testsuites>")
    mark_known(path, {"test_a.py::fails": "tracked in #1"})
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None and (suite.get("failures"), suite.get("skipped")) == ("1", "1")
    skipped = suite.find("testcase/skipped")
    assert skipped is not None and skipped.get("message") == "known failure: tracked in #1"


GOOD = '''
[known-failures]
"test_a.py::short" = "the short form"

[known-failures."test_a.py::long[x,y]"]
reason = "the long form"
expires = 2026-12-31
spec = "eagle"
'''


def test_the_file_parses(tmp_path: Path) -> None:
    (tmp_path / "kf.toml").write_text(GOOD)
    assert load_known(tmp_path / "kf.toml") == [
        KnownFailure("test_a.py::short", "the short form"),
        KnownFailure("test_a.py::long[x,y]", "the long form", date(2026, 12, 31), "eagle")]


def test_ids_are_checked_against_the_suite(tmp_path: Path) -> None:
    """With the suite's directory (as certify gives it), an id's file and function must exist;
    a parametrize id is not enumerated, so one of any brackets is accepted."""
    (tmp_path / "kf.toml").write_text(
        '[known-failures]\n"test_lifecycle.py::test_max_new_tokens[999]" = "r"\n'
        '"test_lossless.py::test_greedy_matches_reference" = "r"\n')
    assert len(load_known(tmp_path / "kf.toml", SUITES)) == 2
    (tmp_path / "kf.toml").write_text(GOOD)
    with pytest.raises(ValueError, match=r"'test_a\.py' is not a suite module"):
        load_known(tmp_path / "kf.toml", SUITES)


def test_a_repro_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "kf" / "repros").mkdir(parents=True)
    (tmp_path / "kf" / "repros" / "x.json").write_text("{}")
    (tmp_path / "kf" / "kf.toml").write_text('[known-failures."test_a.py::a"]\nreason = "r"\n'
                                             'repro = "repros/x.json"\n')
    (entry,) = load_known(tmp_path / "kf" / "kf.toml")
    assert entry.repro == str(tmp_path / "kf" / "repros" / "x.json")


def test_the_vllm_backends_file_names_checks_of_the_suite() -> None:
    entries = load_known(SUITES.parent / "backends" / "vllm" / "known-failures.toml", SUITES)
    assert entries


def test_an_entry_may_name_several_specs(tmp_path: Path) -> None:
    """One id is one TOML key, so a check failing under several specs lists them all; the
    entry excuses nothing elsewhere (a spec where the check passes sees no stale entry)."""
    (tmp_path / "kf.toml").write_text('[known-failures."test_a.py::fails"]\n'
                                      'reason = "r"\nspec = ["eagle", "ngram"]\n')
    entries = load_known(tmp_path / "kf.toml")
    assert entries == [KnownFailure("test_a.py::fails", "r", spec=("eagle", "ngram"))]
    for spec, outcome in (("eagle", "known failure"), ("ngram", "known failure"),
                          ("none", "failed")):
        done = apply_known(results(spec, CHECKS[:1]), entries, "kf.toml", False, TODAY)
        assert done.checks[0].outcome == outcome, spec
        assert not report_of(done).unknown


@pytest.mark.parametrize("text, needle", [
    ("[known-failures\n", "not valid TOML"),
    ('[known-failures."t.py::a"]\nreason = "r"\nowner = "me"\n', "unknown field(s) owner"),
    ('[known-failures."t.py::a"]\nexpires = 2026-01-01\n', "needs a reason"),
    ('[known-failures."t.py::a"]\nreason = "r"\nexpires = "soon"\n', "expires must be a TOML date"),
    ('[known-failures."t.py::a"]\nreason = "r"\nspec = []\n', "spec must be a string or"),
    ('[known-failures]\n"t.py::a" = 3\n', "expected a reason or a table"),
    ('[known-failures]\n"not-an-id" = "r"\n', "is not a check id"),
    ('[other]\n"t.py::a" = "r"\n', "expected only a [known-failures] table"),
    ('[known-failures."test_lifecycle.py::test_stop_at_first_token"]\nreason = "r"\n'
     'spec = "egale"\n', "'test_lifecycle.py::test_stop_at_first_token': unknown spec(s) "
     "'egale' (known: none, eagle,"),
    ('[known-failures."test_lifecycle.py::test_stop_at_first_token"]\nreason = "r"\n'
     'spec = ["eagle", "ngarm"]\n', "unknown spec(s) 'ngarm'"),
    ('[known-failures]\n"test_lifecycle.py::test_stop_at_frist_token" = "r"\n',
     "'test_lifecycle.py::test_stop_at_frist_token': no such check: test_lifecycle.py defines "
     "no check 'test_stop_at_frist_token'"),
    ('[known-failures]\n"test_lifecycel.py::test_stop_at_first_token[x]" = "r"\n',
     "no such check: 'test_lifecycel.py' is not a suite module"),
    ('[known-failures."test_lifecycle.py::test_stop_at_first_token"]\nreason = "r"\n'
     'repro = "nowhere.json"\n', "repro file"),
    ('[known-failures."test_lifecycle.py::test_stop_at_first_token"]\nreason = "r"\n'
     'repro = 3\n', "repro must be a path"),
])
def test_a_bad_file_is_one_line_exit_2_nothing_written(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path, text: str,
        needle: str) -> None:
    (tmp_path / "kf.toml").write_text(text)
    code, _, err = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       "--known-failures", str(tmp_path / "kf.toml"), "--report",
                       str(tmp_path / "r"))
    assert_usage_error(code, err, "--known-failures", needle)
    assert [p.name for p in tmp_path.iterdir()] == ["kf.toml"]


def test_strict_known_needs_a_file(capsys: pytest.CaptureFixture[str], random_model_dir: Path,
                                   tmp_path: Path) -> None:
    code, _, err = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       "--strict-known", "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "--strict-known needs --known-failures")


def test_certify_with_known_failures(capsys: pytest.CaptureFixture[str],
                                     random_model_dir: Path, tmp_path: Path) -> None:
    """A mutant's failures listed as known pass the gate, a listed check that passes is stale
    (the gate fails under --strict-known), an id of no check is warned about on stderr."""
    common = ["certify", "--spec", "none", "--backend", "mutant:ignores_stop_token_ids",
              "--model", str(random_model_dir), "-n", "0", "-k", "test_stop or test_max_new_tokens"]
    assert run(capsys, *common, "--report", str(tmp_path / "plain"))[0] == 1
    failed = [c for c, o in verdicts(tmp_path / "plain").items() if o == "failed"]
    kf = tmp_path / "kf.toml"
    kf.write_text("[known-failures]\n" + "".join(f'"{c}" = "the stop-token bug"\n' for c in failed)
                  + '"test_lifecycle.py::test_max_new_tokens[1]" = "stale by now"\n'
                  + '"test_lifecycle.py::test_max_new_tokens[999]" = "renamed"\n')
    code, out, err = run(capsys, *common, "--known-failures", str(kf), "--report",
                         str(tmp_path / "known"))
    assert code == 0, out
    assert set(verdicts(tmp_path / "known").values()) == {"passed", "known failure"}
    assert ("warning: --known-failures lists test_lifecycle.py::test_max_new_tokens[999]: "
            "matches no check of this run") in err
    assert "stale: test_lifecycle.py::test_max_new_tokens[1]" in out
    assert f"  known failure: {failed[0]}: the stop-token bug\n    message: " in out
    assert f"    replay: specgate repro {tmp_path / 'known'}/repro/" in out
    md = (tmp_path / "known" / "report.md").read_text()
    assert "stale by now" in md and "PASSED (" in md
    code, _, _ = run(capsys, *common, "--known-failures", str(kf), "--strict-known",
                     "--report", str(tmp_path / "strict"))
    assert code == 1


def verdicts(report_dir: Path) -> dict[str, str]:
    report = json.loads((report_dir / "report.json").read_text())
    return {c["nodeid"]: c["outcome"] for c in report["checks"]}
