"""The fuzz tier's state machine: Hypothesis chooses what a client does to a backend.

Each example opens one engine instance (page size, a pool small enough to force retraction or
a roomy one, a forced-retraction schedule, a prefill chunk: each only where the backend claims
what it needs) and then applies rules: submit (prompts from a few tokens to past the 512 and
1024 boundaries; greedy or sampled with every setting; stop tokens and stop strings taken from
the reference's own output, so they really fire, up to three stop strings nested with the
longest listed last; 1 to 24 new tokens), step, abort whatever is live in whatever phase it
is in, session turns, rollbacks (an aborted turn) and closes. Every action goes through
``ActionRunner``, the replay's own, so every step is checked as a replay checks it; at the end
the example runs to completion and must end idle.

When an example fails, Hypothesis shrinks it; the last example it runs is the shrunk one, and
its driver is the one the plugin's ``RecordedRuns`` holds, so the failing check's repro file
is the shrunk scenario.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from conformance.checks.oracle import ReferenceOracle
from conformance.contract import Backend, Capabilities, OpenConfig, SamplingParams
from conformance.plan.prompts import PromptCase, long_prompt
from conformance.plan.requests import context_limit
from conformance.repro.divergence import Diverged
from conformance.repro.record import RecordedRuns
from conformance.repro.replay import ActionRunner, step_allowance
from conformance.repro.scenario import Abort, CloseSession, OpenSession, Run, Step, Submit

ROOMY_POOL = 4096        # tokens: several long requests at once
MAX_LIVE = 6            # requests in flight at once: enough for batches, small enough to shrink
MAX_NEW = 24
MAX_STOPS = 3           # stop strings per request at most
TIGHT_POOL_PROMPT = 96  # prompt tokens at most in a tight pool (each request must fit alone)
BOUNDARIES = (512, 1024)
PAGE_SIZES = (1, 4)     # asked of a memory_view backend, each rounded up to its page_multiple
SESSIONS = ("chat-a", "chat-b")


@contextmanager
def shrink_budget(seconds: float) -> Iterator[None]:
    """Hypothesis shrinks a failure for up to five minutes, longer than a check may take; this
    caps it (its engine reads the limit from a module attribute at each shrink; a Hypothesis
    without it keeps its own). The example kept is the smallest found by then."""
    from hypothesis.internal.conjecture import engine

    namespace = vars(engine)  # the module's globals, which the engine reads the limit from
    before = namespace.get("MAX_SHRINKING_SECONDS")
    if before is None:
        yield
        return
    namespace["MAX_SHRINKING_SECONDS"] = seconds
    try:
        yield
    finally:
        namespace["MAX_SHRINKING_SECONDS"] = before


@dataclass(frozen=True)
class FuzzTarget:
    """What an example runs against: the backend, its claims, the spec configuration and the
    oracle; ``open_config`` builds the run's config (the plugin's, with the run's model and
    graph executor)."""

    backend: Backend
    caps: Capabilities
    open_config: Callable[..., OpenConfig]
    oracle: ReferenceOracle
    prompts: tuple[PromptCase, ...]
    recorded: RecordedRuns
    step_tokens: int = 1  # slots a step may hold per request past its sequence
    page_sizes: tuple[int, ...] = PAGE_SIZES  # what an example may ask, as the backend runs them


def machine_for(target: FuzzTarget) -> type[RuleBasedStateMachine]:
    """A state machine class bound to ``target`` (Hypothesis builds a fresh instance per
    example)."""
    return type("AdapterMachine", (AdapterMachine,), {"target": target})


class AdapterMachine(RuleBasedStateMachine):
    target: FuzzTarget

    def __init__(self) -> None:
        super().__init__()
        self.runner: ActionRunner | None = None
        self.tight = False
        self.count = 0
        self.sessions: dict[str, str | None] = {}  # open session -> its latest turn

    # ---- set-up ------------------------------------------------------------------------------

    @initialize(data=st.data())
    def open_engine(self, data: st.DataObject) -> None:
        t, caps = self.target, self.target.caps
        limits: dict[str, int] = {}
        if caps.memory_view:
            page = data.draw(st.sampled_from(t.page_sizes), label="page_size")
            limits["page_size"] = page
            self.tight = data.draw(st.booleans(), label="tight pool")
            need = TIGHT_POOL_PROMPT + MAX_NEW + 2 * page + 4 * t.step_tokens
            # tight: the largest request alone fits, with a few steps' head-room
            limits["kv_pool_tokens"] = (-(-int(need * 1.6) // page) * page if self.tight
                                        else ROOMY_POOL)
        if caps.forced_retract and data.draw(st.booleans(), label="forced retraction"):
            limits["retract_every"] = data.draw(st.integers(2, 5), label="retract_every")
        if data.draw(st.booleans(), label="chunked prefill"):
            limits["max_prefill_tokens"] = data.draw(st.sampled_from([8, 96]),
                                                     label="max_prefill_tokens")
        t.recorded.clear()  # only this example's driver: the repro is the shrunk example
        self.runner = ActionRunner.open(t.backend, caps, Run(t.open_config(**limits), ()),
                                        t.oracle)
        t.recorded.drivers.append(self.runner.driver)

    def teardown(self) -> None:
        """Run to completion, close the sessions and step once more: the pool must be whole
        (M4, and M5 once the sessions are closed). After a divergence only close (quietly):
        what the example reports is the divergence, not what a broken instance does next."""
        if self.runner is None:
            return
        if self.runner.diverged:
            with contextlib.suppress(Exception):
                self.runner.close()
            return
        try:
            run = self.runner.driver.recorded()
            self.runner.drain(step_allowance(run), len(run.actions))
            for session in sorted(self.sessions):
                self.runner.apply(CloseSession(session))
            if self.sessions:
                self.runner.apply(Step())
        except Diverged:
            with contextlib.suppress(Exception):
                self.runner.close()
            raise
        self.runner.close()

    # ---- what a client does ------------------------------------------------------------------

    @property
    def live(self) -> set[str]:
        return self.runner.driver.live if self.runner else set()

    def _prompt(self, data: st.DataObject) -> list[int]:
        # boundaries a prompt can cross with room for its output (a small model may have none)
        limit = context_limit(self.target.oracle.model)
        boundaries = [b for b in BOUNDARIES if b + 2 * MAX_NEW < limit]
        kinds = ["set", "set", "cut"] + ([] if self.tight or not boundaries else ["long"])
        kind = data.draw(st.sampled_from(kinds), label="prompt kind")
        if kind == "long":
            boundary = data.draw(st.sampled_from(boundaries), label="boundary")
            length = boundary + data.draw(st.integers(-24, 24), label="past the boundary by")
            return list(long_prompt(length, offset=boundary, model=self.target.oracle.model))
        case = data.draw(st.sampled_from(self.target.prompts), label="prompt")
        ids = list(case.ids)
        if kind == "cut" or (self.tight and len(ids) > TIGHT_POOL_PROMPT):
            ids = ids[:data.draw(st.integers(1, min(len(ids), TIGHT_POOL_PROMPT)),
                                 label="prompt tokens")]
        return ids

    def _params(self, data: st.DataObject, prompt: list[int]) -> SamplingParams:
        caps = self.target.caps
        max_new = data.draw(st.integers(1, MAX_NEW), label="max_new_tokens")
        ignore_eos = data.draw(st.booleans(), label="ignore_eos")
        if caps.sampling and data.draw(st.integers(0, 3), label="sampled") == 0:
            return SamplingParams(
                max_new_tokens=max_new, ignore_eos=ignore_eos,
                temperature=data.draw(st.sampled_from([0.5, 1.0]), label="temperature"),
                top_k=data.draw(st.sampled_from([-1, 1, 8]), label="top_k"),
                top_p=data.draw(st.sampled_from([1.0, 0.9]), label="top_p"),
                seed=data.draw(st.integers(0, 3), label="seed"))
        base = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
        stop = data.draw(st.sampled_from(["none", "none", "token", "string"]), label="stop")
        if stop == "none":
            return base
        # a stop that fires: a token the reference itself will emit, or its text
        want = self.target.oracle.greedy(tuple(prompt), base)
        at = data.draw(st.integers(0, len(want) - 1), label="stop at output index")
        if stop == "token":
            return SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos,
                                  stop_token_ids=(want[at],))
        return SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos,
                              stop=self._stop_strings(want, at))

    def _stop_strings(self, want: list[int], at: int) -> tuple[str, ...]:
        """1 to ``MAX_STOPS`` stop strings for output index ``at`` (``1 + at % MAX_STOPS``):
        the token's text, then it with one and with two more characters of the reference's
        text before it. Each later one holds the first, so none completes before it and the
        request ends as with the first alone; where they complete together, the one starting
        earliest in the text is listed last. Taken from ``at`` rather than drawn: a draw of
        their own would change every later choice, and so the examples a profile runs."""
        token = self.target.oracle.decode([want[at]]).strip()
        if not token:
            return ()
        text = self.target.oracle.decode(want[:at + 1]).rstrip()
        start = text.rfind(token)
        longer = [text[start - k:start + len(token)] for k in (1, 2) if start >= k]
        return tuple(dict.fromkeys([token, *longer][:1 + at % MAX_STOPS]))

    @precondition(lambda self: self.runner is not None and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        """A request, or a session's next turn (opening the session for its first)."""
        prompt = self._prompt(data)
        session = None
        if self.target.caps.sessions and data.draw(st.booleans(), label="as a session turn"):
            free = [s for s in SESSIONS if s not in self.sessions or s in self._idle_sessions()]
            session = data.draw(st.sampled_from(free), label="session") if free else None
        if session is not None and session not in self.sessions:
            self.runner.apply(OpenSession(session))
            self.sessions[session] = None
        if session is not None:
            prompt = prompt[:16]  # a turn's new tokens; its context comes from the session
        self.count += 1
        rid = f"r{self.count}"
        self.runner.apply(Submit(rid, tuple(prompt), self._params(data, prompt), session))
        if session is not None:
            self.sessions[session] = rid

    # No arguments: Hypothesis orders rules by their argument count, and shrinks a program's
    # rules towards the first; a step is the neutral one (consecutive steps are one action).
    @precondition(lambda self: self.runner is not None)
    @rule()
    def step(self) -> None:
        self.runner.apply(Step())

    @precondition(lambda self: bool(self.live) and self.target.caps.abort)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.runner.apply(Abort(data.draw(st.sampled_from(sorted(self.live)), label="rid")))

    def _idle_sessions(self) -> list[str]:
        """Open sessions without a live turn (a finished or aborted one ends it)."""
        return sorted(s for s, rid in self.sessions.items() if rid not in self.live)

    @precondition(lambda self: bool(self._idle_sessions()))
    @rule(data=st.data())
    def close_session(self, data: st.DataObject) -> None:
        idle = self._idle_sessions()
        session = data.draw(st.sampled_from(idle), label="session")
        self.runner.apply(CloseSession(session))
        del self.sessions[session]
