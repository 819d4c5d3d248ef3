"""The suite's check names, read from source: the functions and test-class methods pytest would
collect, and why an id names none of them."""

from __future__ import annotations

from pathlib import Path

from conformance.run.suite_checks import suite_checks, unknown_check

SUITES = Path(__file__).resolve().parent.parent / "conformance" / "suites"
MODULE = '''
import pytest


def helper():
    pass


def test_plain(sg):
    pass


async def test_async(sg):
    pass


class TestGroup:
    def test_method(self):
        pass

    def helper(self):
        pass


class Setting:
    def test_not_collected(self):
        pass
'''


def test_what_pytest_would_collect(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(MODULE)
    (tmp_path / "support.py").write_text("def test_not_a_suite_module():\n    pass\n")
    assert suite_checks(tmp_path) == {
        "test_x.py": frozenset({"test_plain", "test_async", "TestGroup::test_method"})}


def test_why_an_id_names_no_check(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(MODULE)
    checks = suite_checks(tmp_path)
    assert unknown_check("test_x.py::test_plain[any-params]", checks) is None
    assert unknown_check("test_x.py::TestGroup::test_method", checks) is None
    assert unknown_check("test_x.py::helper", checks) == "test_x.py defines no check 'helper'"
    assert unknown_check("test_y.py::test_plain", checks) == (
        "'test_y.py' is not a suite module (known: test_x.py)")


def test_the_suite_reads() -> None:
    checks = suite_checks(SUITES)
    assert "test_lossless.py" in checks and "support.py" not in checks
    assert "test_greedy_matches_reference" in checks["test_lossless.py"]
