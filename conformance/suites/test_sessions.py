"""Tier sessions: streaming sessions, several conversations at once, each turn extending the
KV its session kept, under forced retraction, a turn aborted mid-decode and page sizes 1 and 4
(4 only where the backend claims a paged pool, ``memory_view``); and turns that end every way
a turn can end (a stop token, a stop string, EOS, length).

Checked for every turn: the inherited KV it reports is exactly its session's context minus the
final token (the driver's check, ``conformance/repro/driver.py``), its greedy output equals the
reference's over the whole context, M1-M3 after every step (the backend's own strict check
too, for the reference engine), and after the last session is closed the whole pool is free
(M5). An aborted turn rolls its session back: the next turn's context leaves it out; only the
turn the suite aborts may end so (the driver fails any other finish 'abort': a turn given up
under memory pressure instead of retracted looks like a clean rollback). A turn that ends by
a stop keeps its whole output in the context, the stop token included (and every token of a
stop string, though the text is cut before it): the next turn's output shows whether the
backend kept that context and its KV.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import pytest

from conformance.contract import SamplingParams
from conformance.repro.driver import Driver
from conformance.run.context import SuiteContext
from conformance.suites.support import (
    PAGE_SIZES,
    assert_matches_oracle,
    greedy,
    model_property,
    near_tie_epsilon,
    open_driver,
)
from refengine.data import resolve_model_dir
from refengine.model.loader import load_config

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
    params: SamplingParams

    @property
    def rid(self) -> str:
        return f"{self.session}-t{self.index}"


def _script(sg: SuiteContext) -> dict[str, list[Turn]]:
    """Turns per session: new prompts cut from the prompt set, lengths staggered so sessions
    finish turns at different steps."""
    prompts = [list(c.ids)[:NEW_TOKENS] for c in sg.prompts]
    return {f"s{j}": [Turn(f"s{j}", t, prompts[(TURNS * j + t) % len(prompts)],
                           greedy(6 + 2 * ((j + t) % 4))) for t in range(TURNS)]
            for j in range(SESSIONS)}


def _run(driver: Driver, script: Mapping[str, Sequence[Turn]], abort: bool) -> None:
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
                driver.submit(turn.rid, turn.prompt, turn.params, session_id=session)
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


@pytest.mark.parametrize("page_size", PAGE_SIZES)
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
        rid: (driver.turns[rid][1], greedy(len(outcome.output_ids)) if outcome.reason == "abort"
              else turns[rid].params)
        for rid, outcome in driver.outcomes.items()})


# --- turns that end by a stop token, a stop string, EOS or length -----------------------------
#
# Each turn is planned from the reference's greedy continuation over its whole context (earlier
# turns' prompts and whole outputs, then its new tokens), so the stop lands where it was placed:
# past the first tokens of the turn (under speculation, inside or at the edge of an accepted
# run), a stop string spanning the three tokens up to its stop (across a run's tokens or a run
# boundary). Every ending but the last of a session is followed by a turn that reads its
# context; later turns bring only a few new tokens, so their output leans on the kept context's
# last tokens and their KV.

Ending = Literal["stop-token", "stop-string", "eos", "length"]
ENDINGS: dict[str, tuple[Ending, ...]] = {
    "s0": ("stop-token", "stop-string", "length"),
    "s1": ("stop-string", "stop-token", "length"),
    "s2": ("length", "stop-string", "length")}
EOS_ENDINGS: dict[str, tuple[Ending, ...]] = {"s0": ("eos", "length")}
STOPS = ("stop-token", "stop-string")
T = TypeVar("T")
RecordProperty = Callable[[str, object], None]
ENDING_TOKENS = 6    # a stop-ended turn's max_new_tokens
LENGTH_TOKENS = 4    # a length-ended turn's
STOP_FROM = 2        # a stop lands at output index STOP_FROM + the session's number, or later
FOLLOW_TOKENS = 2    # new prompt tokens of a later turn: its output leans on the kept context
EOS_WITHIN = 8       # the EOS case: a prompt the model continues to EOS within this many tokens


@dataclass
class Planned(Turn):
    """A turn and what a fresh request over its whole context gives."""

    plain: SamplingParams  # that fresh request: no stop placed, its output is ``want`` and on
    context: list[int]     # the whole prompt the turn should see
    want: list[int]        # the reference's output
    reason: str            # and finish reason
    text: str | None       # stop strings: the text, cut before the stop


def _finish(sg: SuiteContext, want: list[int], params: SamplingParams) -> tuple[int, str]:
    """How many tokens of the greedy continuation ``want`` a request emits, and why it ends:
    the contract's finish rule, checked after every token."""
    eos = load_config(resolve_model_dir(sg.model)).eos_token_id
    for i, token in enumerate(want[:params.max_new_tokens]):
        if token in params.stop_token_ids or (token == eos and not params.ignore_eos):
            return i + 1, "stop"
        if params.stop and any(s in sg.oracle.decode(want[:i + 1]) for s in params.stop):
            return i + 1, "stop"
    return params.max_new_tokens, "length"


def _stop_params(sg: SuiteContext, ending: Ending, want: list[int], start: int
                 ) -> SamplingParams | None:
    """Parameters that stop the continuation ``want`` at the first output index >= ``start``
    where it can be placed: a token's first occurrence, or a string completed by that token
    and reaching back into the two before it."""
    decode = sg.oracle.decode
    for i in range(max(start, 2), len(want)):
        if ending == "stop-token" and want[i] not in want[:i]:
            return greedy(ENDING_TOKENS, stop_token_ids=(want[i],))
        head, before, text = decode(want[:i - 1]), decode(want[:i]), decode(want[:i + 1])
        if (ending == "stop-string" and head and text.startswith(before)
                and before.startswith(head) and len(head) < len(before) < len(text)):
            stop = text[len(head) - 1:]
            if stop not in before:
                return greedy(ENDING_TOKENS, stop=(stop,))
    return None


def _required(sg: SuiteContext, found: T | None, what: str) -> T:
    """``found``; a turn ending the model cannot be brought to is not applicable, except on a
    bundled fixture, whose prompts are known to give it (there it is a defect of the suite)."""
    model_property(sg, found is not None, f"the model gives no {what}")
    assert found is not None
    return found


_EOS_CASES: dict[tuple[str, str], list[int] | None] = {}


def _eos_case(sg: SuiteContext) -> list[int] | None:
    """A prompt the model continues to EOS within ``EOS_WITHIN`` greedy tokens: the prompt
    set's prompts and then their prefixes that end a line (a file ends after a line), from the
    set's last prompt back, longest first. A property of the model, searched once per run."""
    key = (sg.model, sg.profile.prompt_set)
    if key not in _EOS_CASES:
        params = greedy(EOS_WITHIN, ignore_eos=False)
        eos = load_config(resolve_model_dir(sg.model)).eos_token_id
        cases = [list(c.ids) for c in reversed(sg.prompts)]
        prefixes = [ids[:n] for ids in cases for n in range(len(ids) - 1, 0, -1)
                    if "\n" in sg.oracle.decode(ids[n - 1:n])]
        _EOS_CASES[key] = next((p for p in cases + prefixes
                                if eos in sg.oracle.greedy(tuple(p), params)), None)
    return _EOS_CASES[key]


def _plan(sg: SuiteContext, endings: dict[str, tuple[Ending, ...]]) -> dict[str, list[Planned]]:
    """Each session's turns, one per ending, planned in order over the reference's outputs. A
    first turn is one of the set's shortest whole prompts (their greedy continuations are in
    the committed outputs), a later one brings a cut prompt; where a prompt's continuation
    leaves no place for the turn's stop, the next prompt is tried."""
    cut = [list(c.ids)[:FOLLOW_TOKENS] for c in sg.prompts]
    whole = sorted((list(c.ids) for c in sg.prompts), key=len)
    script: dict[str, list[Planned]] = {}
    for j, (session, kinds) in enumerate(endings.items()):
        context: list[int] = []
        script[session] = []
        for t, ending in enumerate(kinds):
            if ending == "eos":
                assert t == 0, "the EOS case is a prompt of its own: a session's first turn"
                candidates = [_required(sg, _eos_case(sg), f"prompt it continues to EOS within "
                                        f"{EOS_WITHIN} tokens (searched: the prompt set, its "
                                        f"lines)")]
            else:
                prompts, first = (whole, j) if t == 0 else (cut, j + 3 * t)
                candidates = [prompts[(first + k) % len(prompts)] for k in range(len(prompts))]
            turn = _required(sg, next(filter(None, (
                _plan_turn(sg, (session, t), prompt, ending, context, STOP_FROM + j)
                for prompt in candidates)), None),
                f"prompt whose continuation has a place for a {ending} ({session}, turn {t})")
            script[session].append(turn)
            context = turn.context + turn.want
    return script


def _plan_turn(sg: SuiteContext, where: tuple[str, int], prompt: list[int], ending: Ending,
               context: list[int], stop_from: int) -> Planned | None:
    """Turn ``where`` (session, index) bringing ``prompt`` after ``context``, ending by
    ``ending`` (a stop at output index ``stop_from`` or later); None where the continuation
    leaves no place for the stop."""
    full = context + prompt
    plain = {"eos": greedy(EOS_WITHIN, ignore_eos=False),
             "length": greedy(LENGTH_TOKENS)}.get(ending, greedy(ENDING_TOKENS))
    want = sg.oracle.greedy(tuple(full), plain)
    params = _stop_params(sg, ending, want, stop_from) if ending in STOPS else plain
    if params is None:
        return None
    n, reason = _finish(sg, want, params)
    text = sg.oracle.finish_text(want[:n], params.stop) if params.stop else None
    return Planned(*where, prompt, params, plain, full, want[:n], reason, text)


def _assert_endings(sg: SuiteContext, driver: Driver, script: dict[str, list[Planned]]) -> None:
    """Every turn against a fresh request over the context planned for it (earlier turns'
    prompts and whole outputs, then its own): the context the driver gave it (and checked its
    cached-token count against), its tokens, finish reason and, for a stop string, its text.
    A difference at a near-tie ends its session's comparison (listed in ``near_ties``): the
    rest of the session continues another context."""
    epsilon = near_tie_epsilon(sg)
    bad, ties = [], []
    for turns in script.values():
        for turn in turns:
            got, seen = driver.outcomes[turn.rid], driver.turns[turn.rid][1]
            if seen != turn.context:
                at = next((i for i, (a, b) in enumerate(zip(seen, turn.context, strict=False))
                           if a != b), min(len(seen), len(turn.context)))
                bad.append(f"{turn.rid}: its context ({len(seen)} tokens) differs from the "
                           f"earlier turns' prompts and whole outputs ({len(turn.context)}) "
                           f"at position {at}")
                break
            found = sg.oracle.divergence(tuple(seen), turn.plain, got.output_ids, epsilon)
            if found is not None and found.got is not None:  # a token differs, or one too many
                if found.near_tie:
                    ties.append(f"{turn.rid}@{found.index} margin={found.margin:.3g}")
                else:
                    bad.append(f"{turn.rid}: {found.describe()}")
                break
            if ((got.output_ids, got.reason) != (turn.want, turn.reason)
                    or (turn.text is not None and got.text != turn.text)):
                bad.append(f"{turn.rid}: ended by {got.reason!r} after {len(got.output_ids)} "
                           f"tokens, text ending {got.text[-12:]!r}; a fresh request ends by "
                           f"{turn.reason!r} after {len(turn.want)}"
                           + ("" if turn.text is None else f", text ending {turn.text[-12:]!r}"))
                break
    if ties:
        sg.extend_property("near_ties", ties)
    assert not bad, f"{len(bad)} session(s) went wrong: {bad}"


def _stop_placement(turn: Planned, accept_lens: list[int]) -> str:
    """Where a stop-ended turn's last token sat: its prefill, or the k-th token of its verify
    step's run (cut there); k > 1 means a stop completed after the first token of a run."""
    index, start = len(turn.want) - 1, 1
    if index == 0:
        return f"{turn.rid}: prefill"
    for run in accept_lens:
        if index < start + run:
            return f"{turn.rid}: token {index - start + 1} of its run"
        start += run
    return f"{turn.rid}: past the accept lengths {accept_lens}"


def _check_endings(sg: SuiteContext, endings: dict[str, tuple[Ending, ...]],
                   record_property: RecordProperty) -> None:
    script = _plan(sg, endings)
    with open_driver(sg) as driver:
        _run(driver, script, abort=False)
        for session in script:
            driver.close_session(session)
        driver.step()  # idle: with every session closed, M4 and M5 hold (the driver checks)
    _assert_endings(sg, driver, script)
    if any(outcome.accept_lens for outcome in driver.outcomes.values()):
        record_property("stops", [
            _stop_placement(turn, driver.outcomes[turn.rid].accept_lens)
            for turns in script.values() for turn in turns if turn.reason == "stop"])


def test_turns_ending_by_stop(sg: SuiteContext, record_property: RecordProperty) -> None:
    """Turns that end by a stop token, a stop string or length, sessions side by side, each
    but a session's last followed by a turn that continues its context."""
    _check_endings(sg, ENDINGS, record_property)


def test_turn_ending_by_eos(sg: SuiteContext, record_property: RecordProperty) -> None:
    """A turn that ends by EOS (the EOS token stays in the context), then a turn after it."""
    _check_endings(sg, EOS_ENDINGS, record_property)
