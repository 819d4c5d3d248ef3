"""``Capabilities.page_multiple``: a backend whose pool pages must be a multiple of N tokens
declares N; the suite, the repro replay and the fuzz tier ask it page sizes rounded up to N
(``effective_page_size``), and the driver holds the memory view to the page size asked
(docs/adapter.md, "Page sizes"). Shown both ways: the reference engine behind an adapter that
takes multiples of 32 only passes the page-size checks at 32, and one that claims a memory
view but ignores the page size fails them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks.invariants import InvariantError
from conformance.contract import (
    FLAG_NAMES,
    Capabilities,
    Event,
    MemoryView,
    OpenConfig,
    effective_page_size,
)
from conformance.plan.run_plan import RunPlan
from conformance.report.results import CheckRow
from conformance.repro.driver import Driver
from conformance.repro.replay import ActionRunner
from conformance.repro.scenario import Run
from conformance.run.suite import SuiteOptions, run_suite

LOSSLESS_PAGE_4 = "test_lossless.py::test_greedy_matches_reference[plain-batch-4]"
MEMORY_PAGE_1 = "test_memory.py::test_invariants_under_pressure[plain-1]"


def test_page_sizes_round_up_to_the_multiple() -> None:
    assert [effective_page_size(Capabilities(), p) for p in (1, 4, 7)] == [1, 4, 7]
    four = Capabilities(page_multiple=4)
    assert [effective_page_size(four, p) for p in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert [effective_page_size(Capabilities(page_multiple=32), p) for p in (1, 4, 64)] == [
        32, 32, 64]


@pytest.mark.parametrize("bad", [0, -32, True, 2.0, "32"])
def test_page_multiple_is_a_positive_integer_and_not_a_flag(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^page_multiple: expected a positive integer"):
        Capabilities(page_multiple=bad)  # type: ignore[arg-type]
    assert "page_multiple" not in FLAG_NAMES
    assert Capabilities(page_multiple=32).as_dict()["page_multiple"] == 32
    with pytest.raises(ValueError, match="unknown capability"):
        Capabilities().claims("page_multiple")


class IdleHandle:
    """Nothing live; its memory view reports pages of ``page_size``."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def step(self) -> list[Event]:
        return []

    def memory(self) -> MemoryView:
        return MemoryView(capacity=64, free=64, held=0, page_size=self.page_size)


@pytest.mark.parametrize(("asked", "reported", "fails"), [
    (4, 4, False), (None, 32, False), (4, 1, True), (32, 4, True)])
def test_the_driver_holds_the_view_to_the_page_size_asked(asked: int | None, reported: int,
                                                          fails: bool) -> None:
    driver = Driver(IdleHandle(reported), Capabilities(memory_view=True),  # type: ignore[arg-type]
                    config=OpenConfig(page_size=asked))
    if not fails:
        driver.step()
        return
    with pytest.raises(InvariantError, match=rf"^step 1: page size: the memory view reports "
                                             rf"page_size {reported}, but the backend was "
                                             rf"opened with page_size {asked} "):
        driver.step()


class RecordingBackend:
    """Takes pages of a multiple of 4; records the configs it is opened with."""

    name = "recording"
    version = "0"

    def __init__(self) -> None:
        self.opened: list[OpenConfig] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(stepwise=True, memory_view=True, page_multiple=4)

    def open(self, cfg: OpenConfig) -> IdleHandle:
        self.opened.append(cfg)
        return IdleHandle(cfg.page_size or 4)


@pytest.mark.parametrize(("recorded", "opened"), [(1, 4), (4, 4), (6, 8), (None, None)])
def test_a_replay_opens_at_the_page_size_the_backend_runs(recorded: int | None,
                                                          opened: int | None) -> None:
    backend = RecordingBackend()
    runner = ActionRunner.open(backend, backend.capabilities(),  # type: ignore[arg-type]
                               Run(OpenConfig(page_size=recorded, kv_pool_tokens=96), ()),
                               oracle=None)  # type: ignore[arg-type]
    assert [c.page_size for c in backend.opened] == [opened]
    assert runner.driver.config == backend.opened[0]


def certify(tmp_path: Path, factory: str, only: tuple[str, ...]) -> dict[str, CheckRow]:
    """check id -> its row in the results, from a gate run of the suite on ``factory``."""
    opts = SuiteOptions(RunPlan(f"tests.conforming_variants:{factory}", ("none",), only=only))
    run = run_suite(opts, tmp_path / "results.json")
    assert run.results is not None, run.problems
    return {c.nodeid: c for c in run.results.checks}


def test_fixed_pages_run_at_the_multiple_and_say_so(tmp_path: Path) -> None:
    """The variant refuses any page size that is not a multiple of 32: it passes because the
    suite asks 32, and each check records the page size it ran at beside the one it asked."""
    rows = certify(tmp_path, "fixed_pages", (LOSSLESS_PAGE_4, MEMORY_PAGE_1))
    assert {check: row.outcome for check, row in rows.items()} == {
        LOSSLESS_PAGE_4: "passed", MEMORY_PAGE_1: "passed"}
    assert rows[LOSSLESS_PAGE_4].figures["page_size_run"] == ["32 (asked 4)"]
    assert rows[MEMORY_PAGE_1].figures["page_size_run"] == ["32 (asked 1)"]


def test_a_memory_view_that_ignores_the_page_size_fails(tmp_path: Path) -> None:
    rows = certify(tmp_path, "ignores_page_size", (LOSSLESS_PAGE_4,))
    assert rows[LOSSLESS_PAGE_4].outcome == "failed"
    assert ("page size: the memory view reports page_size 1, but the backend was opened with "
            "page_size 4") in rows[LOSSLESS_PAGE_4].message
