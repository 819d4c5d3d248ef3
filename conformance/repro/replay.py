"""Replay a scenario against a backend and find its first divergence.

Each run opens the backend with its recorded ``OpenConfig`` and applies the actions through the
suite's ``Driver`` (so the invariants after every step are the suite's own, a finish 'abort'
for a request the scenario does not abort among them); every greedy request's tokens are
compared with the reference's as they stream, so the divergence found is the first one in
time, at the step that produced it. A token that differs where the reference
is at a near-tie for the backend's declared precision ends that request's comparison, as in
the lossless tier. After its actions a run steps until every request has finished (and must
end idle); the finish reason must agree with where the reference's output ends, and a stop
string's finish text must be cut before the earliest one in it. A request whose submit records
accept lengths (a golden failure's) must have emitted them at its first verify steps.

``ActionRunner`` is shared with the fuzz tier, which applies the actions its state machine
chooses the same way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

from conformance.checks.calibration import near_tie_allowance
from conformance.checks.invariants import InvariantError
from conformance.checks.oracle import ReferenceOracle
from conformance.contract import (
    Backend,
    Capabilities,
    FinishEvent,
    SamplingParams,
    TokenEvent,
    effective_page_size,
)
from conformance.plan.profiles import PROFILES
from conformance.plan.requests import context_limit
from conformance.repro.divergence import Diverged, Divergence, raised_text, show_memory
from conformance.repro.driver import Driver, backend_call, step_budget
from conformance.repro.requirements import check_applicable
from conformance.repro.scenario import (
    Abort,
    Action,
    CloseSession,
    OpenSession,
    Run,
    Scenario,
    Step,
    Submit,
    describe,
)

WAIT_STEPS = 10_000  # how long an action may wait for what it needs to finish


@dataclass
class _Watched:
    prompt: tuple[int, ...]
    params: SamplingParams
    want: list[int] | None = None  # the reference's greedy output, once asked for
    tied: bool = False             # a near-tie ended its comparison
    accept_lens: tuple[int, ...] | None = None  # its first verify steps', as recorded


@dataclass
class ActionRunner:
    """Applies actions to one engine instance, checking as it goes; raises ``Diverged``."""

    driver: Driver
    oracle: ReferenceOracle
    epsilon: float
    run: int = 0
    index: int = 0  # of the action being applied, in the driver's record (steps merged)
    # seeded sampled requests finished so far (shared by a scenario's runs): what a claim of
    # seeded_sampling says must come out again for the same request
    seeded: dict[tuple[object, ...], tuple[str, list[int]]] = field(default_factory=dict)
    _watched: dict[str, _Watched] = field(default_factory=dict)
    _label: str = ""                 # the action being applied, as the divergence names it
    _before: str | None = None       # the memory view before it
    _step_no: int = 0                # the step it is in (a step) or after (any other action)
    diverged: bool = False           # a divergence was raised: the instance is past checking

    @classmethod
    def open(cls, backend: Backend, caps: Capabilities, run: Run, oracle: ReferenceOracle,
             number: int = 0) -> ActionRunner:
        """Open ``backend`` with the run's config, its page size rounded up to what the
        backend can honour (``effective_page_size``): a scenario recorded on another
        backend replays at the nearest page size this one runs."""
        config = run.config
        if config.page_size is not None:
            config = replace(config, page_size=effective_page_size(caps, config.page_size))
        try:
            with backend_call("backend.open()"):
                handle = backend.open(config)
        except Exception as err:
            raise Diverged(Divergence(number, -1, "open the backend", 0, None,
                                      "the backend opens with the run's config",
                                      raised_text(err))) from err
        spec = config.spec
        driver = Driver(handle, caps, overlap=spec is not None and spec.overlap, config=config)
        # judged as the gate judges: a failure the gate calls real replays as real
        epsilon = near_tie_allowance(config.model, caps.precision, PROFILES["gate"])
        return cls(driver, oracle, epsilon, number)

    def close(self) -> None:
        try:
            with backend_call("handle.close()"):
                self.driver.handle.close()
        except Exception as err:
            raise Diverged(Divergence(self.run, self.index, "close the backend",
                                      self.driver.steps, None, "the handle closes",
                                      raised_text(err))) from err

    def _memory(self) -> str | None:
        if not self.driver.caps.memory_view:
            return None
        try:
            return show_memory(self.driver.handle.memory())
        except Exception as err:  # the block still shows what the failing call was
            return f"(memory() raised {raised_text(err)})"

    def apply(self, action: Action, label: str = "", index: int | None = None) -> None:
        """``label``: how a divergence names the action (default: the action itself);
        ``index``: its place in the scenario (default: in the driver's record so far)."""
        if index is not None:
            self.index = index
        elif not label:
            log = self.driver.actions
            merges = isinstance(action, Step) and bool(log) and isinstance(log[-1], Step)
            self.index = len(log) - 1 if merges else len(log)
        self._label = label or describe(action)
        self._before = None if isinstance(action, Step) else self._memory()
        try:
            if isinstance(action, Step):
                for _ in range(action.times):
                    self._step()
            else:
                self._call(action)
        except Diverged:
            raise
        except Exception as err:  # a case timeout (a BaseException) fails the check as such
            came = str(err) if isinstance(err, InvariantError) else raised_text(err)
            expected = ("the suite's invariants hold" if isinstance(err, InvariantError)
                        else "the call returns")
            self._diverge(getattr(action, "rid", None), expected, came, err)

    def _busy(self, action: Action) -> bool:
        """The action needs something still live to finish first: its request id (reused), or
        its session's current turn (a next turn, a close)."""
        live = self.driver.live
        if isinstance(action, Submit) and action.rid in live:
            return True
        session = action.session if isinstance(action, (Submit, CloseSession)) else None
        return session is not None and any(
            self.driver.turns.get(rid, ("",))[0] == session for rid in live)

    def _call(self, action: Action) -> None:
        """Apply ``action``; one the recorded backend could take at this point but this one
        cannot yet (it runs the request or turn it waits for more slowly) first steps until it
        can, as the recording check did by waiting for it."""
        d = self.driver
        waited = d.steps
        while self._busy(action):
            if d.steps - waited > WAIT_STEPS:
                self._diverge(getattr(action, "rid", None), "what it waits for finishes",
                              f"still live after {WAIT_STEPS} steps")
            self._step()
        self._step_no = d.steps
        if isinstance(action, Submit):
            d.submit(action.rid, list(action.prompt_ids), action.params, action.session)
            full = d.turns[action.rid][1] if action.session else list(action.prompt_ids)
            self._watched[action.rid] = _Watched(tuple(full), action.params,
                                                 accept_lens=action.accept_lens)
        elif isinstance(action, Abort) and action.rid in d.live:
            # the contract says nothing of aborting a finished request: a request the recorded
            # backend still ran may already have finished here
            d.abort(action.rid)
        elif isinstance(action, OpenSession):
            d.open_session(action.session)
        elif isinstance(action, CloseSession):
            d.close_session(action.session)

    def _step(self) -> None:
        self._step_no = self.driver.steps + 1
        self._before = self._memory()  # the view before this very step
        for ev in self.driver.step():
            if isinstance(ev, TokenEvent):
                self._check_tokens(ev.rid, final=None)
            elif isinstance(ev, FinishEvent):
                self._check_tokens(ev.rid, final=ev)

    def drain(self, max_steps: int, index: int) -> None:
        """Step until nothing is live (what every run ends with); ``index``: its place in the
        scenario, after the last action."""
        start, self.index = self.driver.steps, index
        while self.driver.live:
            if self.driver.steps - start >= max_steps:
                self._label = "run to completion"
                self._diverge(None, "every request finishes", f"no progress after {max_steps} "
                              f"steps: {sorted(self.driver.live)[:5]} still live")
            self.apply(Step(), "run to completion")

    def _check_tokens(self, rid: str, final: FinishEvent | None) -> None:
        """``rid``'s output so far against the reference; at its finish, also its length and
        reason."""
        w = self._watched[rid]
        got = self.driver.outcomes[rid].output_ids if final else self.driver.streamed[rid]
        if final is not None and final.reason == "abort":
            return
        if final is not None and final.reason == "stop" and w.params.stop:
            self._check_stop_text(rid, final)
        room = min(w.params.max_new_tokens, context_limit(self.oracle.model) - len(w.prompt))
        if final is not None and final.reason == "length" and len(got) != room:
            self._diverge(rid, f"'length' only after {room} tokens (max_new_tokens "
                          f"{w.params.max_new_tokens}, context limit)",
                          f"finish 'length' after {len(got)} tokens")
        if final is not None and not w.params.greedy:
            self._check_seeded(rid, w, list(got))
        if not w.params.greedy or w.tied:
            return
        if w.want is None:
            w.want = self.oracle.greedy(w.prompt, w.params)
        want = w.want
        ended = final is not None
        if got == (want if ended else want[:len(got)]):
            if ended and len(want) < room and final.reason != "stop":
                self._diverge(rid, f"finish 'stop' (the reference stops after {len(want)} "
                              f"of {room} tokens)", f"finish {final.reason!r}")
            if ended:
                self._check_acceptance(rid, w)
            return
        found = self.oracle.divergence(w.prompt, w.params, list(got), self.epsilon)
        if found is not None and found.near_tie:
            w.tied = True
            return
        what = found.describe() if found is not None else "differs"
        self._diverge(rid, f"the reference's greedy output ({len(want)} tokens)",
                      f"{len(got)} tokens{' at its finish' if ended else ' so far'}: {what}")

    def _check_acceptance(self, rid: str, w: _Watched) -> None:
        """A finished request's first verify steps emitted the tokens the scenario records
        (a draft that got worse is lossless: only its acceptance shows it)."""
        if w.accept_lens is None:
            return
        want = list(w.accept_lens)
        got = self.driver.outcomes[rid].accept_lens[:len(want)]
        if got == want:
            return
        step = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    len(got))
        came = (f"{got[step]} tokens at verify step {step}" if step < len(got)
                else f"only {len(got)} verify steps")
        self._diverge(rid, f"the recorded accept lengths of its first {len(want)} verify steps "
                      f"({want[step]} tokens at verify step {step})", came)

    def _check_stop_text(self, rid: str, final: FinishEvent) -> None:
        """A request with stop strings that finished by ``stop`` reports its own output's text
        cut before the earliest stop string in it (whole where none occurs)."""
        want = self.oracle.finish_text(list(final.output_ids), self._watched[rid].params.stop)
        if final.text != want:
            self._diverge(rid, f"finish text ending {want[-16:]!r} (cut before the earliest "
                          f"stop string)", f"finish text ending {final.text[-16:]!r}")

    def _check_seeded(self, rid: str, w: _Watched, got: list[int]) -> None:
        """A seeded sampled request that finished: the same request (prompt, parameters, spec
        configuration) must have come out the same wherever it ran before, in any batch or
        engine instance, where the backend claims ``seeded_sampling`` (under speculation only
        if neither was retracted: the claim covers retraction under plain decoding alone)."""
        spec = self.driver.config.spec if self.driver.config else None
        if (w.params.seed is None or not self.driver.caps.seeded_sampling
                or (spec is not None and self.driver.retracted[rid])):
            return
        key = (spec, w.prompt, w.params)
        earlier = self.seeded.setdefault(key, (f"run {self.run} request {rid!r}", got))
        if earlier[1] != got:
            first = next((i for i, (a, b) in enumerate(zip(earlier[1], got, strict=False))
                          if a != b), min(len(got), len(earlier[1])))
            self._diverge(rid, f"the {len(earlier[1])} tokens {earlier[0]} gave (same prompt, "
                          f"parameters and seed {w.params.seed})",
                          f"{len(got)} tokens, different from output index {first} on")

    def _diverge(self, rid: str | None, expected: str, came: str,
                 cause: BaseException | None = None) -> None:
        self.diverged = True
        raise Diverged(Divergence(self.run, self.index, self._label, self._step_no, rid,
                                  expected, came, self._before, self._memory())) from cause


def step_allowance(run: Run) -> int:
    """A generous bound on the steps a run's drain may take (the driver's own budget)."""
    return step_budget([(list(a.prompt_ids), a.params) for a in run.actions
                        if isinstance(a, Submit)])


def replay(scenario: Scenario, backend: Backend, oracle: ReferenceOracle | None = None
           ) -> Divergence | None:
    """The first divergence of ``backend`` from what the scenario checks, or None (clean)."""
    caps = backend.capabilities()
    check_applicable(scenario, backend.name, caps)
    oracles = {oracle.model: oracle} if oracle is not None else {}
    seeded: dict[tuple[object, ...], tuple[str, list[int]]] = {}
    for number, run in enumerate(scenario.runs):
        model = run.config.model
        oracles.setdefault(model, ReferenceOracle(model))
        try:
            runner = ActionRunner.open(backend, caps, run, oracles[model], number)
        except Diverged as err:
            return err.divergence
        runner.seeded = seeded
        try:
            for index, action in enumerate(run.actions):
                runner.apply(action, index=index)
            runner.drain(step_allowance(run), len(run.actions))
        except Diverged as err:
            with contextlib.suppress(Diverged):  # the first divergence is the one to show
                runner.close()
            return err.divergence
        try:
            runner.close()
        except Diverged as err:
            return err.divergence
    return None
