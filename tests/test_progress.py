"""Progress output: per-item lines for golden/bench/mutants, per-tier counts for certify."""

from __future__ import annotations

import importlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from conformance.report.progress import Steps, TierProgress, backend_progress, tier_of

SUITES = Path(__file__).resolve().parents[1] / "conformance" / "suites"


def plain_console() -> tuple[Console, io.StringIO]:
    """A console that is not a terminal, as in a CI log."""
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=200), buffer


@pytest.mark.parametrize("path", sorted(SUITES.glob("test_*.py")), ids=lambda p: p.name)
def test_each_suite_file_holds_the_tier_its_name_says(path: Path) -> None:
    """The controller of an xdist run sees node ids only, so tier totals come from file names;
    that holds only while every check in test_<tier>.py is marked with tier <tier>."""
    assert path.read_text().count("specgate_tier(") == 1, "one tier marker per suite file"
    module = importlib.import_module(f"conformance.suites.{path.stem}")
    marks = module.pytestmark if isinstance(module.pytestmark, list) else [module.pytestmark]
    tiers = [m.args[0] for m in marks if m.name == "specgate_tier"]
    assert tiers == [tier_of(f"{path.name}::test_x")]


def test_tier_of_node_ids() -> None:
    assert tier_of("test_lossless.py::test_a[1-2]") == "lossless"
    assert tier_of("conformance/suites/test_memory.py::test_b") == "memory"


def test_steps_leave_one_line_per_item_off_a_terminal() -> None:
    console, buffer = plain_console()
    with Steps("golden check", 2, console) as steps:
        steps.start("chain-s3-n4")
        steps.done("matches")
        steps.start("chain-s5-n6")
        steps.note("detail")
        steps.done("DIFFERS")
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "[1/2] chain-s3-n4 ..."
    assert lines[1].startswith("[1/2] chain-s3-n4: matches (") and lines[1].endswith(" s)")
    assert lines[2:4] == ["[2/2] chain-s5-n6 ...", "    detail"]
    assert lines[4].startswith("[2/2] chain-s5-n6: DIFFERS (")


def _report(nodeid: str, when: str, outcome: str, progress: tuple[str, ...] = ()
            ) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, failed=outcome == "failed",
                           user_properties=[("specgate_progress", list(progress))])


def test_tier_progress_counts_checks_and_failures_per_tier() -> None:
    console, buffer = plain_console()
    progress = TierProgress(console)
    ids = ["test_memory.py::a", "test_memory.py::b", "test_lossless.py::c"]
    progress.pytest_xdist_node_collection_finished(None, ids)
    progress.pytest_xdist_node_collection_finished(None, ids)  # the second worker: same ids
    phases = {"test_memory.py::a": ("passed", "failed", "failed"),  # call and teardown fail
              "test_memory.py::b": ("passed", "passed", "passed")}
    for nodeid, outcomes in phases.items():
        for when, outcome in zip(("setup", "call", "teardown"), outcomes, strict=True):
            progress.pytest_runtest_logreport(_report(nodeid, when, outcome))
    progress.pytest_sessionfinish()
    out = buffer.getvalue()
    assert "3 checks in 2 tiers: lossless 1, memory 2" in out
    assert "memory: 2/2 checks, 1 failed" in out  # a check failing twice counts once
    assert "lossless:" not in out.split("tiers:")[1].split("\n", 1)[1]  # not finished


def test_a_check_whose_worker_died_is_done() -> None:
    console, buffer = plain_console()
    progress = TierProgress(console)
    progress.pytest_xdist_node_collection_finished(None, ["test_lossless.py::c"])
    progress.pytest_runtest_logreport(_report("test_lossless.py::c", "setup", "passed"))
    progress.pytest_runtest_logreport(_report("test_lossless.py::c", "???", "failed"))  # xdist's
    progress.pytest_sessionfinish()
    assert "lossless: 1/1 checks, 1 failed" in buffer.getvalue()


def test_the_backends_progress_lines_are_shown_as_each_check_ends() -> None:
    """Only ``specgate: `` lines of the captured stderr are the backend's progress; the tier
    progress prints them when the check they came from ends."""
    assert backend_progress("noise\nspecgate: compiled verify-n4-b8-kv256 in 20.1 s (1 this "
                            "run, 20 s in all)\n  specgate: indented\n") == [
        "specgate: compiled verify-n4-b8-kv256 in 20.1 s (1 this run, 20 s in all)"]
    console, buffer = plain_console()
    progress = TierProgress(console)
    progress.pytest_xdist_node_collection_finished(None, ["test_golden.py::a"])
    line = "specgate: compiled decode-b1-kv256 in 1.5 s"
    progress.pytest_runtest_logreport(_report("test_golden.py::a", "call", "passed", (line,)))
    assert line not in buffer.getvalue()  # not before the check has ended
    progress.pytest_runtest_logreport(_report("test_golden.py::a", "teardown", "passed", (line,)))
    progress.pytest_sessionfinish()
    assert f"    {line}" in buffer.getvalue()
