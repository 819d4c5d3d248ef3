"""``conformance.repro.driver.Driver``: a backend that stalls fails a check instead of hanging it;
a finish ``abort`` the suite did not ask for fails."""

from __future__ import annotations

import pytest

from conformance.checks.invariants import InvariantError
from conformance.contract import (
    Capabilities,
    Event,
    FinishEvent,
    FinishReason,
    Request,
    SamplingParams,
    TokenEvent,
)
from conformance.repro.driver import Driver


class StallingHandle:
    """Accepts requests and never produces an event."""

    def submit(self, req: Request) -> None:
        pass

    def step(self) -> list[Event]:
        return []


class OneTokenPerStepHandle(StallingHandle):
    def __init__(self) -> None:
        self.rids: list[str] = []

    def submit(self, req: Request) -> None:
        self.rids.append(req.rid)

    def step(self) -> list[Event]:
        return [TokenEvent(rid, (7,)) for rid in self.rids]


def test_step_until_gives_up_after_max_steps() -> None:
    driver = Driver(StallingHandle(), Capabilities())  # type: ignore[arg-type]
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvariantError, match=r"no progress after 5 steps: r streamed nothing"):
        driver.step_until(lambda: bool(driver.streamed["r"]), 5, lambda: "r streamed nothing")
    assert driver.steps == 5
    with pytest.raises(InvariantError, match=r"no progress after 3 steps: 1 requests still live"):
        driver.run(3)


def test_step_until_stops_as_soon_as_done() -> None:
    driver = Driver(OneTokenPerStepHandle(), Capabilities())  # type: ignore[arg-type]
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=4))
    driver.step_until(lambda: len(driver.streamed["r"]) >= 2, 10, lambda: "never")
    assert driver.steps == 2 and driver.streamed["r"] == [7, 7]


class FinishesEveryStepHandle(StallingHandle):
    """Finishes every submitted request with ``reason`` at the next step."""

    def __init__(self, reason: FinishReason) -> None:
        self.reason = reason
        self.rids: list[str] = []

    def submit(self, req: Request) -> None:
        self.rids.append(req.rid)

    def abort(self, rid: str) -> None:
        pass

    def step(self) -> list[Event]:
        events: list[Event] = [FinishEvent(rid, self.reason, ()) for rid in self.rids]
        self.rids.clear()
        return events


def test_an_abort_nobody_asked_for_fails() -> None:
    driver = Driver(FinishesEveryStepHandle("abort"), Capabilities())  # type: ignore[arg-type]
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvariantError, match=r"step 1: request 'r' finished 'abort' after 0 "
                                             r"tokens, but the suite never aborted it"):
        driver.step()


def test_an_abort_asked_for_is_a_finish() -> None:
    driver = Driver(FinishesEveryStepHandle("abort"), Capabilities())  # type: ignore[arg-type]
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=2))
    driver.abort("r")
    driver.step()
    assert driver.outcomes["r"].reason == "abort" and not driver.live


def test_an_abort_asked_for_covers_only_that_submit() -> None:
    """A request id submitted again after an aborted run starts unaborted."""
    driver = Driver(FinishesEveryStepHandle("abort"), Capabilities())  # type: ignore[arg-type]
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=2))
    driver.abort("r")
    driver.step()
    driver.submit("r", [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvariantError, match="never aborted it"):
        driver.step()
