"""The golden traces of a prompt set: which requests each holds and how they run.

* ``plain`` (``<prompt-set>.json``): every prompt of the set, in one batch.
* ``chunked`` (``<prompt-set>-chunked.json``): the first ``CHUNKED_PROMPTS`` prompts that take
  at least three chunks under a per-step prefill budget of ``CHUNK_TOKENS``
  (``max_prefill_tokens``), in one batch: the drafter must follow every chunk of a prompt (its
  KV, the target's hidden states), not only the one that completes it.
* ``sessions`` (``<prompt-set>-sessions.json``): ``SESSIONS`` streaming sessions of two turns;
  a second turn brings only its new tokens and inherits the first turn's prompt and completion,
  so the drafter must continue from the session's context, not start from the turn's tokens.
* ``retract`` (``<prompt-set>-retract.json``): the first ``RETRACT_PROMPTS`` prompts in one
  batch under the forced-retraction hook (``retract_every``: the middle decoding request every
  ``RETRACT_EVERY`` decode steps); a retracted request re-prefills its prompt and output, so
  the drafter must go on from the re-prefilled context, not from the prompt.

The chunked, session and retraction traces are short (``SCENARIO_TOKENS`` per request) and
run whole in every profile: a session's second turn is only comparable after the first turn
the trace recorded, and a retraction lands where the hook's step count puts it. The recorder
and the golden tier run a trace's requests in the same ``waves``, so the reference engine
reproduces every batch, and every float, it recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:  # the CLI reads the scenario names without loading a tokenizer
    from conformance.plan.prompts import PromptCase

CHUNK_TOKENS = 64     # the chunked trace's max_prefill_tokens
CHUNKED_PROMPTS = 6
SCENARIO_TOKENS = 32  # tokens per request of the chunked and session traces
SESSIONS = 6
TURN_PROMPT_TOKENS = 16  # at most this many new tokens in a second turn
RETRACT_PROMPTS = 6
RETRACT_EVERY = 2     # the retraction trace's retract_every (decode steps)


@dataclass(frozen=True)
class Planned:
    """A request of a trace before it runs: a session's turn carries its new tokens only."""

    id: str
    prompt_ids: list[int]
    session_id: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    suffix: str                     # of the trace's file name, after the prompt set's
    max_new_tokens: int | None      # None: what the recorder is asked for (the plain trace)
    max_prefill_tokens: int | None  # None: the engine's own budget
    plan: Callable[[Sequence[PromptCase]], list[Planned]]
    retract_every: int = 0          # the forced-retraction hook (0: off)

    def trace_name(self, prompt_set: str) -> str:
        return prompt_set + self.suffix


def _plain(cases: Sequence[PromptCase]) -> list[Planned]:
    return [Planned(c.id, list(c.ids)) for c in cases]


def _chunked(cases: Sequence[PromptCase]) -> list[Planned]:
    long = [c for c in cases if len(c.ids) > 2 * CHUNK_TOKENS]
    return [Planned(c.id, list(c.ids)) for c in long[:CHUNKED_PROMPTS]]


def _sessions(cases: Sequence[PromptCase]) -> list[Planned]:
    """Session j: case 2j's prompt, then the first tokens of case 2j + 1 as the second turn."""
    pairs = [(cases[2 * j], cases[2 * j + 1]) for j in range(min(SESSIONS, len(cases) // 2))]
    return [turn for j, (first, second) in enumerate(pairs) for turn in (
        Planned(f"s{j}-t0-{first.id}", list(first.ids), f"s{j}"),
        Planned(f"s{j}-t1-{second.id}", list(second.ids[:TURN_PROMPT_TOKENS]), f"s{j}"))]


def _retracted(cases: Sequence[PromptCase]) -> list[Planned]:
    return _plain(cases[:RETRACT_PROMPTS])


PLAIN = Scenario("plain", "", None, None, _plain)
CHUNKED = Scenario("chunked", "-chunked", SCENARIO_TOKENS, CHUNK_TOKENS, _chunked)
SESSION_TURNS = Scenario("sessions", "-sessions", SCENARIO_TOKENS, None, _sessions)
RETRACTED = Scenario("retract", "-retract", SCENARIO_TOKENS, None, _retracted, RETRACT_EVERY)
SCENARIOS = {s.name: s for s in (PLAIN, CHUNKED, SESSION_TURNS, RETRACTED)}


class _InSession(Protocol):
    @property
    def session_id(self) -> str | None: ...


R = TypeVar("R", bound=_InSession)


def waves(requests: Sequence[R]) -> list[list[R]]:
    """How a trace's requests run: wave i holds every session's turn i (in trace order), and
    the requests of no session join the first wave. Each wave is submitted at once and runs to
    completion before the next, so a turn's context is its session's earlier turns, finished."""
    out: list[list[R]] = []
    turns: Counter[str] = Counter()
    for req in requests:
        i = 0
        if req.session_id is not None:
            i = turns[req.session_id]
            turns[req.session_id] += 1
        while len(out) <= i:
            out.append([])
        out[i].append(req)
    return out


def sessions_of(requests: Sequence[R]) -> list[str]:
    """The sessions a trace's requests belong to, in order of first appearance."""
    return list(dict.fromkeys(r.session_id for r in requests if r.session_id is not None))
