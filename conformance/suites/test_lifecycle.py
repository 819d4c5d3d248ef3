"""Tier lifecycle: request edges that crash or leak in real engines — tiny outputs, a stop at
the first token, abort in every phase, arrivals after everything finished, idle to busy; and,
under overlap scheduling, a request that finishes, is aborted or is retracted while a launched
step of it is still unresolved (that step's result is stale and must change nothing).

Where a check expects exact tokens (a stop placed on the reference's output, the tokens an
aborted request streamed), a request whose output first differs from the reference's at a
near-tie for the backend's declared precision is listed in ``near_ties`` and not compared
further, as in the lossless tier: its continuation legitimately differs, and a stop placed on
the reference's output need not come."""

from __future__ import annotations

import pytest

from conformance.repro.driver import Driver
from conformance.run.context import SuiteContext
from conformance.suites.support import (
    assert_matches_oracle,
    greedy,
    model_property,
    near_tied,
    open_driver,
    run_all,
)
from conformance.suites.support_in_flight import assert_acceptance_accounts, in_flight_of
from conformance.suites.support_stops import (
    assert_stop_strings,
    stops_to_compare,
    string_offsets,
)

pytestmark = pytest.mark.specgate_tier("lifecycle")


def _longest(sg: SuiteContext) -> list[int]:
    return list(max(sg.prompts, key=lambda c: len(c.ids)).ids)


def _assert_phase(driver: Driver, phase: str) -> None:
    """The abort case is only meaningful if the victim really is in ``phase`` when aborted:
    what it streamed says whether it decodes, and the memory view (if claimed) whether it
    holds KV and in which phase."""
    where = f"step {driver.steps}, before aborting the victim"
    streamed = len(driver.streamed["victim"])
    assert (streamed > 0) == (phase == "decoding"), (
        f"{where}: meant to be {phase}, but it streamed {streamed} tokens")
    if not driver.caps.memory_view:
        return
    held = driver.handle.memory().requests.get("victim")
    if phase == "queued":
        assert held is None or held.allocated == 0, (
            f"{where}: meant to be queued, but it holds KV {held}")
    else:
        assert held is not None and held.phase == ("prefill" if phase == "prefilling"
                                                   else "decode"), (
            f"{where}: meant to be {phase}, but its KV is {held}")


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens(sg: SuiteContext, max_new_tokens: int) -> None:
    requests = {c.id: (list(c.ids), greedy(max_new_tokens)) for c in sg.prompts[:4]}
    with open_driver(sg) as driver:
        outcomes = run_all(driver, requests)
    for rid, o in outcomes.items():
        assert len(o.output_ids) == max_new_tokens and o.reason == "length", (rid, o)
    assert_matches_oracle(sg, outcomes, requests)


def test_stop_at_first_token(sg: SuiteContext) -> None:
    prompt = list(sg.prompts[0].ids)
    first = sg.oracle.greedy(tuple(prompt), greedy(1))[0]
    with open_driver(sg) as driver:
        outcomes = run_all(driver, {"r": (prompt, greedy(16, stop_token_ids=(first,)))})
    for rid in stops_to_compare(sg, prompt, outcomes, {"r": 1}):
        assert outcomes[rid].output_ids == [first] and outcomes[rid].reason == "stop", (
            outcomes[rid])


def test_new_arrivals_after_everything_finished(sg: SuiteContext) -> None:
    first = {c.id: (list(c.ids), greedy(6)) for c in sg.prompts[:3]}
    second = {f"{c.id}-again": (list(c.ids), greedy(9)) for c in sg.prompts[2:5]}
    with open_driver(sg) as driver:
        outcomes = run_all(driver, first)
        assert not driver.live, f"step {driver.steps}: still live after run_all: {driver.live}"
        outcomes.update(run_all(driver, second))
    assert_matches_oracle(sg, outcomes, {**first, **second})


def test_all_finish_in_one_step_then_new_arrivals(sg: SuiteContext) -> None:
    """Every request finishes in the same step (all-finish-in-verify: under speculation, inside one
    verify); the engine must then take new arrivals (the next merge of spec state)."""
    first = {f"{c.id}-a": (list(c.ids), greedy(2)) for c in sg.prompts[:4]}
    second = {f"{c.id}-b": (list(c.ids), greedy(5)) for c in sg.prompts[2:6]}
    third = first | {"again": (list(sg.prompts[0].ids), greedy(3))}  # finished rids reused
    with open_driver(sg) as driver:
        for requests in (first, second, third):
            assert_matches_oracle(sg, run_all(driver, requests), requests)


def test_stop_token_at_every_offset(sg: SuiteContext) -> None:
    """A stop token at each of the first output positions: under speculation these fall at
    every offset of an accepted run, and nothing after the stop may be emitted."""
    prompt = list(sg.prompts[0].ids)
    want = sg.oracle.greedy(tuple(prompt), greedy(24))
    requests = {}
    for i, token in enumerate(want):
        if 0 < i <= 16 and token not in want[:i]:  # first occurrence: the stop lands at i
            requests[f"stop-at-{i}"] = (prompt, greedy(24, stop_token_ids=(token,)))
    model_property(sg, len(requests) >= 4,
                   "the first prompt's greedy output gives too few distinct early tokens to "
                   "place stops at")
    with open_driver(sg) as driver:
        outcomes = run_all(driver, requests)
    ends = {rid: int(rid.rsplit("-", 1)[1]) + 1 for rid in requests}
    for rid in stops_to_compare(sg, prompt, outcomes, ends):
        n, o = ends[rid], outcomes[rid]
        assert o.output_ids == want[:n] and o.reason == "stop", (
            f"{rid}: got {len(o.output_ids)} tokens ({o.reason}), expected {n} (stop)")


def test_stop_string_at_every_offset(sg: SuiteContext) -> None:
    """A stop string completed by each of the first output tokens and reaching back into the
    token before it: under speculation these fall at every offset of an accepted run and across
    run boundaries. The output ends at the token that completes the string, and the text just
    before the string; nothing after it is emitted."""
    prompt = list(sg.prompts[0].ids)
    want = sg.oracle.greedy(tuple(prompt), greedy(24))
    stops = {}
    for i, before, text in string_offsets(sg, want):
        stop = text[len(before) - 1:]  # the last character before token i, then token i's
        if stop not in before:  # else it would complete earlier
            stops[f"stop-at-{i}"] = (i, (stop,))
    model_property(sg, len(stops) >= 4,
                   "the first prompt's greedy output gives too few offsets to place stop strings")
    assert_stop_strings(sg, prompt, want, stops)


def test_earliest_of_several_stop_strings(sg: SuiteContext) -> None:
    """Several stop strings at each of the first output tokens: the text that token i would
    add next (listed first, never reached), the last character before token i and token i's
    (listed second), and the last two characters before it and token i's (listed last). The
    last two complete together at token i; the finish text is cut before the one that starts
    earliest in it, the last listed, not before the first listed that occurs."""
    prompt = list(sg.prompts[0].ids)
    want = sg.oracle.greedy(tuple(prompt), greedy(24))
    stops = {}
    for i, before, text in string_offsets(sg, want):
        near, far = text[len(before) - 1:], text[len(before) - 2:]
        after = sg.oracle.decode(want[:i + 2])
        unreached = after[len(text):] if after.startswith(text) else ""
        strings = (unreached, near, far) if unreached and unreached not in text else (near, far)
        if (len(before) >= 2 and near not in before  # far holds near: neither completes earlier
                and text.find(far) < text.find(near)):  # the earliest is not the first listed
            stops[f"stops-at-{i}"] = (i, strings)
    model_property(sg, len(stops) >= 4,
                   "the first prompt's greedy output gives too few offsets to place several "
                   "stop strings at")
    assert_stop_strings(sg, prompt, want, stops)


@pytest.mark.specgate_requires("stepwise", "forced_retract")
def test_retract_middle_request(sg: SuiteContext) -> None:
    """The middle of three requests is retracted (every 2nd step) and resumes exactly."""
    requests = {c.id: (list(c.ids), greedy(20)) for c in sg.prompts[:3]}
    with open_driver(sg, retract_every=2) as driver:
        outcomes = run_all(driver, requests)
        assert driver.retractions > 0, (
            f"retract_every=2 retracted nothing in {driver.steps} steps: the backend claims "
            "forced_retract, and this case checked no resumption")
    assert_matches_oracle(sg, outcomes, requests)


@pytest.mark.specgate_requires("stepwise", "forced_retract")
def test_retract_the_only_request(sg: SuiteContext) -> None:
    """A lone decoding request is retracted (every 2nd step): a step that retracts every
    decoding request still reports it (R1, with a memory view: its KV went), and the request
    resumes exactly."""
    requests = {"lone": (list(sg.prompts[0].ids), greedy(12))}
    with open_driver(sg, retract_every=2) as driver:
        outcomes = run_all(driver, requests)
        assert driver.retracted["lone"] > 0, (
            f"retract_every=2 reported no retraction of the only request in {driver.steps} "
            "steps: the backend claims forced_retract, so a retraction of every decoding "
            "request went unreported")
    assert_matches_oracle(sg, outcomes, requests)


@pytest.mark.specgate_requires("stepwise", "forced_retract", "memory_view")
def test_retracted_request_is_not_overtaken(sg: SuiteContext) -> None:
    """Three requests fill the three running slots and a fourth, submitted after them, waits;
    the middle one is retracted (every 2nd step) and must be re-admitted before the fourth is
    admitted (R2, checked after every step). Requires: memory_view (it shows admission)."""
    requests = {f"r{i}": (list(c.ids), greedy(16)) for i, c in enumerate(sg.prompts[:4])}
    with open_driver(sg, max_running_requests=3, retract_every=2) as driver:
        outcomes = run_all(driver, requests)
        assert driver.retraction.contested > 0, (
            f"in {driver.steps} steps no request was retracted while one submitted after it "
            f"waited (retractions: {dict(driver.retracted)}): the case checked no overtaking")
    assert_matches_oracle(sg, outcomes, requests)


def test_idle_to_busy(sg: SuiteContext) -> None:
    requests = {"late": (list(sg.prompts[1].ids), greedy(5))}
    with open_driver(sg) as driver:
        for _ in range(3):
            assert driver.step() == [], "an idle engine must report no events"
        outcomes = run_all(driver, requests)
    assert_matches_oracle(sg, outcomes, requests)


@pytest.mark.specgate_requires("stepwise", "abort")
@pytest.mark.parametrize("phase", [
    "queued",
    # Caught mid-prompt only where prompts are cut into chunks: a backend that prefills a
    # prompt whole streams its first token in the same step, and conforms.
    pytest.param("prefilling", marks=pytest.mark.specgate_requires("chunked_prefill")),
    "decoding"])
def test_abort(sg: SuiteContext, phase: str) -> None:
    """Abort one request in the given phase; the other runs on unharmed; nothing leaks."""
    victim = _longest(sg)
    bystander = {"bystander": (list(sg.prompts[0].ids), greedy(12))}
    limits = {"queued": {"max_running_requests": 1}, "prefilling": {"max_prefill_tokens": 8},
              "decoding": {}}[phase]
    with open_driver(sg, **limits) as driver:
        # Queued: once the bystander decodes it holds the only running slot (a limit every
        # backend must honour) and the victim waits. Prefilling: the victim goes first and its
        # long prompt is cut into 8-token chunks, so one step leaves it mid-prompt.
        order = ["victim", "bystander"] if phase == "prefilling" else ["bystander", "victim"]
        for rid in order:
            if rid == "victim":
                driver.submit("victim", victim, greedy(24))
            else:
                driver.submit(rid, *bystander[rid])
        if phase == "queued":
            driver.step_until(lambda: bool(driver.streamed["bystander"]), 1000,
                              lambda: "the bystander streamed no token")
        elif phase == "prefilling":
            driver.step()
        elif phase == "decoding":
            driver.step_until(lambda: bool(driver.streamed["victim"]), 1000,
                              lambda: "the victim streamed no token")
            driver.step()
        _assert_phase(driver, phase)
        driver.abort("victim")
        outcomes = driver.run(10_000)
    assert outcomes["victim"].reason == "abort", (
        f"victim aborted while {phase} finished with {outcomes['victim'].reason!r} after "
        f"{len(outcomes['victim'].output_ids)} tokens")
    streamed = driver.streamed["victim"]
    want = sg.oracle.greedy(tuple(victim), greedy(24))
    assert (streamed == want[:len(streamed)] or "victim" in near_tied(
        sg, {"victim": streamed}, {"victim": (victim, greedy(len(streamed)))})), (
        "tokens streamed before the abort were wrong")
    assert_matches_oracle(sg, outcomes, bystander)


@pytest.mark.specgate_requires("stepwise", "abort")
def test_abort_frees_the_only_running_slot(sg: SuiteContext) -> None:
    """One running slot: abort the decoding request that holds it, then submit another. An
    aborted request left in the running list would keep the slot forever (the next request
    is never admitted); without this case that bug shows only when a random load mix happens
    to pick the dead request for retraction."""
    victim, after = list(sg.prompts[0].ids), list(sg.prompts[1].ids)
    with open_driver(sg, max_running_requests=1) as driver:
        driver.submit("victim", victim, greedy(24))
        driver.step_until(lambda: bool(driver.streamed["victim"]), 1000,
                          lambda: "the victim streamed no token")
        driver.abort("victim")
        outcomes = run_all(driver, {"after": (after, greedy(6))})
    assert driver.outcomes["victim"].reason == "abort", (
        f"victim finished as {driver.outcomes['victim'].reason!r}, not aborted")
    assert_matches_oracle(sg, outcomes, {"after": (after, greedy(6))})


# --- stale results: acting on a request while a launched step of it is unresolved -------------

@pytest.mark.specgate_requires("stepwise", "abort", "in_flight")
def test_abort_while_step_in_flight(sg: SuiteContext) -> None:
    """Abort a decoding request whose next step is launched and unresolved: it gets no token
    of that step, and its KV (the step's reservation included) is freed."""
    requests = {c.id: (list(c.ids), greedy(24)) for c in sg.prompts[:3]}
    victim = next(iter(requests))
    with open_driver(sg) as driver:
        in_flight = in_flight_of(driver)
        for rid, (prompt, params) in requests.items():
            driver.submit(rid, prompt, params)
        driver.step_until(lambda: len(driver.streamed[victim]) >= 2 and victim in in_flight(),
                          1000, lambda: f"{victim} never decoded with a step in flight")
        before = list(driver.streamed[victim])
        driver.abort(victim)
        outcomes = driver.run(10_000)
    assert outcomes[victim].reason == "abort", f"{victim} finished as {outcomes[victim].reason}"
    assert driver.streamed[victim] == before == outcomes[victim].output_ids, (
        f"{victim} had {len(before)} tokens when aborted with a step in flight, then streamed "
        f"{len(driver.streamed[victim]) - len(before)} more and finished with "
        f"{len(outcomes[victim].output_ids)}")
    assert_acceptance_accounts(driver, victim, outcomes[victim])
    assert_matches_oracle(sg, outcomes, {r: q for r, q in requests.items() if r != victim})


@pytest.mark.specgate_requires("stepwise", "in_flight")
def test_finish_while_step_in_flight(sg: SuiteContext) -> None:
    """Requests that meet a stop token while their next step is already launched (a length
    limit the launch can foresee, a stop it cannot): the stale step adds no token, no
    acceptance and no KV (M1-M4 after every step)."""
    requests = {}
    for i, c in enumerate(sg.prompts[:4]):
        want = sg.oracle.greedy(tuple(c.ids), greedy(24))
        at = next((j for j in range(3 + i, len(want)) if want[j] not in want[:j]), None)
        if at is not None:  # the stop lands exactly at output index ``at``
            requests[c.id] = (list(c.ids), greedy(24, stop_token_ids=(want[at],)))
    model_property(sg, len(requests) >= 2,
                   "the prompt set's greedy outputs give too few distinct tokens to place stops")
    finished_in_flight: set[str] = set()
    with open_driver(sg) as driver:
        in_flight = in_flight_of(driver)
        for rid, (prompt, params) in requests.items():
            driver.submit(rid, prompt, params)
        while driver.live:
            driver.step()
            finished_in_flight |= in_flight() & set(driver.outcomes)
            assert driver.steps < 10_000, f"no progress: live {sorted(driver.live)}"
        driver.step()  # resolves the last stale step; the idle checks run after it
    assert finished_in_flight, (
        f"no request finished while a launched step of it was unresolved "
        f"(finished: {sorted(driver.outcomes)}): the stale path went unchecked")
    for rid in finished_in_flight:
        assert_acceptance_accounts(driver, rid, driver.outcomes[rid])
    assert_matches_oracle(sg, driver.outcomes, requests)


@pytest.mark.specgate_requires("stepwise", "forced_retract", "in_flight")
def test_retract_while_step_in_flight(sg: SuiteContext) -> None:
    """Forced retraction of requests whose launched step is unresolved: the stale step adds
    nothing, the request re-prefills and resumes exactly."""
    requests = {c.id: (list(c.ids), greedy(20)) for c in sg.prompts[:3]}
    hit: set[str] = set()
    with open_driver(sg, retract_every=2) as driver:
        in_flight = in_flight_of(driver)
        for rid, (prompt, params) in requests.items():
            driver.submit(rid, prompt, params)
        while driver.live:
            flying, retracted = in_flight(), dict(driver.retracted)
            driver.step()
            hit |= {r for r in flying if driver.retracted[r] > retracted.get(r, 0)}
            assert driver.steps < 10_000, f"no progress: live {sorted(driver.live)}"
    assert hit, (f"retract_every=2 retracted {dict(driver.retracted)}, none while a launched "
                 f"step of it was unresolved: the stale path went unchecked")
    for rid in requests:
        assert_acceptance_accounts(driver, rid, driver.outcomes[rid])
    assert_matches_oracle(sg, driver.outcomes, requests)
