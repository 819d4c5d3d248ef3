"""Ctrl-C in every long-running command: exit 130 within seconds, one line, no traceback, and
nothing reported for the case that was cut short. certify keeps a complete certificate of the
checks that finished, marked incomplete, whose counts match its junit.xml.

Each command runs in its own process group and gets SIGINT the way a terminal sends Ctrl-C: to
the whole group (pytest-xdist workers included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 5.0


@dataclass
class Stopped:
    code: int
    stdout: str
    stderr: str
    seconds_after_signal: float


def interrupt(argv: list[str], ready: Callable[[str], bool], cwd: Path,
              settle_s: float = 0.0, startup_timeout_s: float = 240.0) -> Stopped:
    """Start ``specgate argv``, wait until a stderr line satisfies ``ready`` (plus
    ``settle_s``), send SIGINT to its process group and wait for it to exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "conformance.cli", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            # a shell's background jobs inherit SIGINT ignored; a terminal's
                            # foreground job, which this imitates, does not
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err_lines: list[str] = []
    seen = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if ready(line):
                seen.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    out_chunks: list[str] = []
    out_reader = threading.Thread(
        target=lambda: out_chunks.append(proc.stdout.read() if proc.stdout else ""),
        daemon=True)
    out_reader.start()
    try:
        assert seen.wait(startup_timeout_s), "never got ready:\n" + "".join(err_lines)
        assert proc.poll() is None, "finished before it could be interrupted"
        time.sleep(settle_s)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    out_reader.join(10)
    return Stopped(code, "".join(out_chunks), "".join(err_lines), elapsed)


def assert_stopped_cleanly(stopped: Stopped) -> str:
    """Exit 130 within the deadline, and the interrupt is one line, the last one."""
    assert stopped.code == 130, (stopped.code, stopped.stderr[-2000:])
    assert stopped.seconds_after_signal < DEADLINE_S, stopped.seconds_after_signal
    for stream in (stopped.stdout, stopped.stderr):
        assert "Traceback" not in stream and "KeyboardInterrupt" not in stream, stream[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("specgate: interrupted"), stopped.stderr[-2000:]
    assert len([ln for ln in stopped.stderr.splitlines() if "interrupted" in ln]) == 1
    return last


def test_certify_writes_an_incomplete_certificate(random_model_dir: Path,
                                                  tmp_path: Path) -> None:
    report = tmp_path / "report"
    stopped = interrupt(["certify", "--spec", "none", "--model", str(random_model_dir),
                         "--report", str(report), "-n", "2"],
                        ready=lambda line: "checks" in line and "/" in line, cwd=tmp_path)
    last = assert_stopped_cleanly(stopped)
    assert "INCOMPLETE" in last
    cert = json.loads((report / "report.json").read_text())
    assert cert["status"] == "incomplete" and cert["interrupted"] is True
    assert "INCOMPLETE (interrupted)" in (report / "report.md").read_text()
    counts = {o: sum(t["counts"][o] for t in cert["tiers"])
              for o in ("passed", "failed", "not claimed", "skipped")}
    suite = ET.parse(report / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    total = int(suite.get("tests", -1))
    # the checks that finished, plus one testcase saying the run is incomplete (an error, so a
    # CI test report cannot read the finished checks as the whole run passing)
    assert total == sum(counts.values()) + 1 == len(cert["checks"]) + 1 > 1
    (marker,) = [c for c in suite.iter("testcase") if c.get("name") == "run_incomplete"]
    error = marker.find("error")
    assert error is not None and "the run was interrupted" in str(error.get("message"))
    assert suite.get("specgate_incomplete") == "true"
    assert int(suite.get("failures", -1)) + int(suite.get("errors", -1)) == counts["failed"] + 1
    assert int(suite.get("skipped", -1)) == counts["not claimed"] + counts["skipped"]
    assert total < 40, "the run was meant to be cut short"
    # every tier it did not finish says so, with how many checks did not run
    cut = [t for t in cert["tiers"] if t["status"] == "incomplete"]
    assert cut, cert["tiers"]
    assert all(any(w.startswith("incomplete: the run was interrupted") for w in t["not_run"])
               for t in cut)
    assert all(t["status"] != "passed" or sum(t["counts"].values()) > 0 for t in cert["tiers"])
    assert sorted(p.name for p in report.iterdir()) == ["junit.xml", "report.json",
                                                        "report.md"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")], \
        "a staging directory was left behind"


def test_mutants_reports_nothing_for_the_interrupted_mutant(random_model_dir: Path,
                                                           tmp_path: Path) -> None:
    # A speculative mutant under plain decoding is the reference engine: it runs the whole
    # suite, long enough to be interrupted mid-run.
    stopped = interrupt(["mutants", "--model", str(random_model_dir), "--spec", "none",
                         "--only", "stop_inside_run_ignored,leak_on_finish"],
                        ready=lambda line: line.startswith("[1/2] stop_inside_run_ignored"),
                        cwd=tmp_path, settle_s=2.0)
    assert_stopped_cleanly(stopped)
    assert "survived" not in stopped.stdout + stopped.stderr
    assert stopped.stdout.strip() == ""  # no table: no verdict for a mutant cut short


@pytest.mark.parametrize("argv, ready", [
    (["golden", "check", "--spec", "eagle"], "[1/8] chain-s3-n4"),  # 2 configs x 4 traces
    (["bench", "--backends", "refengine", "--batch-sizes", "1", "--max-new-tokens", "48",
      "--min-requests", "64", "--graphs", "none"], "[1/1] batch 1"),
], ids=["golden", "bench"])
def test_golden_and_bench_stop_with_one_line(argv: list[str], ready: str,
                                             tmp_path: Path) -> None:
    stopped = interrupt(argv, ready=lambda line: line.startswith(ready), cwd=tmp_path,
                        settle_s=1.0)
    assert_stopped_cleanly(stopped)
    assert stopped.stdout.strip() == ""
