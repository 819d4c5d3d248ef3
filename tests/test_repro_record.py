"""``conformance.repro.record.write_repro``: a failing check's scenario is written and replayed
against the same backend; where the replay does not run (the backend refuses it, or the check
timed out) reproduction stays unknown and the row says why, never that it replays clean."""

from __future__ import annotations

from pathlib import Path

from conforming_variants import NoAbortBackend

from conformance.contract import Capabilities, OpenConfig, SamplingParams
from conformance.repro.driver import Driver
from conformance.repro.record import TIMED_OUT, RecordedRuns, write_repro
from conformance.repro.scenario import Abort, Step, Submit

CHECK = "test_worker.py::test_filter_to_zero_rows_then_new_arrivals"


def aborting_run() -> RecordedRuns:
    """A recorded run that submits a request, steps and aborts it (nothing is executed)."""
    driver = Driver(None, Capabilities(), config=OpenConfig())  # type: ignore[arg-type]
    driver.actions = [Submit("r", (1, 2, 3), SamplingParams(max_new_tokens=4)), Step(2),
                      Abort("r"), Step()]
    return RecordedRuns([driver])


def test_a_refused_replay_is_not_replayed_with_why(tmp_path: Path) -> None:
    props = write_repro(aborting_run(), tmp_path, CHECK, "boom", "variant:no_abort",
                        NoAbortBackend())
    assert (tmp_path / str(props["specgate_repro"])).is_file()
    assert props["specgate_repro_reproduces"] is None, props
    assert props["specgate_repro_not_replayed"] == (
        "backend 'variant:no_abort' does not claim abort, which the scenario needs"), props


def test_a_timed_out_check_is_not_replayed_with_why(tmp_path: Path) -> None:
    props = write_repro(aborting_run(), tmp_path, CHECK, "boom", "variant:no_abort",
                        NoAbortBackend(), replay_it=False)
    assert props["specgate_repro_reproduces"] is None
    assert props["specgate_repro_not_replayed"] == TIMED_OUT
