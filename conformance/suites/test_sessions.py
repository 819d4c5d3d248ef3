"""Tier sessions: streaming sessions, several conversations at once, each turn extending the
KV its session kept, under forced retraction, a turn aborted mid-decode and page sizes 1 and 4.

Checked for every turn: the inherited KV it reports is exactly its session's context minus the
final token (the driver's check, ``conformance/run/driver.py``), its greedy output equals the
reference's over the whole context, M1-M3 after every step (the backend's own strict check
too, for the reference engine), and after the last session is closed the whole pool is free
(M5). An aborted turn rolls its session back: the next turn's context leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from conformance.run.driver import Driver
from conformance.run.plugin import SuiteContext
from conformance.suites.support import assert_matches_oracle, greedy, open_driver

pytestmark = [pytest.mark.specgate_tier("sessions"),
              pytest.mark.specgate_requires("stepwise", "sessions")]

SESSIONS = 3
TURNS = 3
NEW_TOKENS = 10   # at most this many new prompt tokens per turn
ABORTED = ("s1", 1)  # (session, turn) aborted mid-decode in the abort cases


@dataclass
class Turn:
    session: str
    index: int
    prompt: list[int]
    max_new_tokens: int

    @property
    def rid(self) -> str:
        return f"{self.session}-t{self.index}"


def _script(sg: SuiteContext) -> dict[str, list[Turn]]:
    """Turns per session: new prompts cut from the prompt set, lengths staggered so sessions
    finish turns at different steps."""
    prompts = [list(c.ids)[:NEW_TOKENS] for c in sg.prompts]
    return {f"s{j}": [Turn(f"s{j}", t, prompts[(TURNS * j + t) % len(prompts)],
                           6 + 2 * ((j + t) % 4)) for t in range(TURNS)]
            for j in range(SESSIONS)}


def _run(driver: Driver, script: dict[str, list[Turn]], abort: bool) -> None:
    """Every session's turns in order, sessions side by side (the driver records each turn's
    whole prompt).
    In the abort case the aborted turn is cut mid-decode (while a step of it is in flight,
    when the backend can say so) and the session goes on with its next turn."""
    pending = {s: list(turns) for s, turns in script.items()}
    current: dict[str, Turn] = {}
    for session in script:
        driver.open_session(session)
    in_flight = (getattr(driver.handle, "in_flight", None)
                 if driver.overlap and driver.caps.in_flight else None)
    aborted = False
    while pending or current:
        for session in list(pending):
            if session not in current:
                turn = pending[session].pop(0)
                if not pending[session]:
                    del pending[session]
                params = greedy(turn.max_new_tokens)
                driver.submit(turn.rid, turn.prompt, params, session_id=session)
                current[session] = turn
        victim = current.get(ABORTED[0])
        if (abort and not aborted and victim is not None and victim.index == ABORTED[1]
                and len(driver.streamed[victim.rid]) >= 2
                and (in_flight is None or victim.rid in in_flight())):
            driver.abort(victim.rid)
            aborted = True
        driver.step()
        assert driver.steps < 5_000, f"sessions made no progress: live {sorted(driver.live)}"
        for session, turn in list(current.items()):
            if turn.rid in driver.outcomes:
                del current[session]
    assert aborted or not abort, (
        f"turn {ABORTED} finished before it could be aborted mid-decode "
        f"(streamed {driver.streamed.get('s1-t1')})")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("abort", [False, pytest.param(True, marks=pytest.mark.specgate_requires(
    "abort"))], ids=["no-abort", "abort"])
@pytest.mark.parametrize("retract_every", [0, pytest.param(3, marks=pytest.mark.specgate_requires(
    "forced_retract"))], ids=["no-retract", "retract"])
def test_session_turns(sg: SuiteContext, page_size: int, abort: bool, retract_every: int,
                       record_property) -> None:
    script = _script(sg)
    with open_driver(sg, page_size=page_size, retract_every=retract_every) as driver:
        _run(driver, script, abort)
        if driver.caps.memory_view:
            view = driver.handle.memory()
            assert view.held > 0 and view.rows_held == SESSIONS, (
                f"after the last turn, {SESSIONS} open sessions hold {view.held} KV slots in "
                f"{view.rows_held} rows: their KV was not kept")
        for session in script:
            driver.close_session(session)
        driver.step()  # idle: with every session closed, M4 and M5 hold (the driver checks)
        record_property("retractions", driver.retractions)
        record_property("steps", driver.steps)
    if retract_every:
        inherited = [rid for rid in driver.retracted if not rid.endswith("-t0")]
        assert inherited, (
            f"forced retraction every {retract_every} steps hit no turn that had inherited KV "
            f"(retracted: {dict(driver.retracted)}): the rollback to a cached prefix went "
            f"unchecked")
    victim = f"{ABORTED[0]}-t{ABORTED[1]}"
    assert not abort or driver.outcomes[victim].reason == "abort", (
        f"{victim} finished as {driver.outcomes[victim].reason!r}, not aborted")
    turns = {t.rid: t for session_turns in script.values() for t in session_turns}
    # Each turn against a fresh request over its whole context; an aborted turn is checked on
    # what it streamed before the abort.
    assert_matches_oracle(sg, driver.outcomes, {
        rid: (driver.turns[rid][1], greedy(len(outcome.output_ids) if outcome.reason == "abort"
                                           else turns[rid].max_new_tokens))
        for rid, outcome in driver.outcomes.items()})
