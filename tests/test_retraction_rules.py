"""R1 (retract events match the memory view) and R2 (a retracted request is not overtaken by a
later arrival), as ``RetractionWatch`` judges them step by step; and, over random loads, a toy
scheduler that re-queues a retracted request at the front never breaks them, while one that
re-queues it at the back does."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.retraction import RetractionWatch
from conformance.contract import Event, FinishEvent, MemoryView, ReqKV, RetractEvent, TokenEvent


def _view(**kv: int) -> MemoryView:
    return MemoryView(capacity=100, free=100 - sum(kv.values()), held=0, page_size=1,
                      requests={rid: ReqKV(n, n) for rid, n in kv.items()})


def _watch(*rids: str, inherited: int = 0) -> RetractionWatch:
    watch = RetractionWatch()
    for rid in rids:
        watch.submitted(rid, inherited)
    return watch


def test_kv_lost_without_a_retract_event_breaks_r1() -> None:
    watch = _watch("a", "b")
    assert watch.observe(1, [], _view(a=10, b=10), {"a", "b"}) is None
    problem = watch.observe(2, [], _view(a=11), {"a", "b"})
    assert problem and problem.startswith("R1") and "'b' lost KV" in problem
    assert "left the memory view" in problem


def test_kv_shrunk_without_a_retract_event_breaks_r1() -> None:
    watch = _watch("a")
    watch.observe(1, [], _view(a=10), {"a"})
    problem = watch.observe(2, [], _view(a=4), {"a"})
    assert problem and "committed 10, now 4" in problem


def test_kv_released_by_finish_abort_or_retraction_is_not_lost() -> None:
    watch = _watch("a", "b", "c")
    watch.observe(1, [], _view(a=10, b=10, c=10), {"a", "b", "c"})
    # a finished, b was asked to abort (not passed as live), c was retracted
    events: list[Event] = [FinishEvent("a", "length", (1,), ""), RetractEvent("c")]
    assert watch.observe(2, events, _view(), {"c"}) is None


def test_a_retracted_request_still_holding_kv_breaks_r1() -> None:
    watch = _watch("a")
    watch.observe(1, [], _view(a=10), {"a"})
    problem = watch.observe(2, [RetractEvent("a")], _view(a=10), {"a"})
    assert problem and "reported retracted" in problem and "holds 10 positions" in problem


def test_a_retracted_session_turn_keeps_its_inherited_prefix() -> None:
    watch = _watch("turn", inherited=6)
    watch.observe(1, [], _view(turn=12), {"turn"})
    assert watch.observe(2, [RetractEvent("turn")], _view(turn=6), {"turn"}) is None
    problem = watch.observe(3, [RetractEvent("turn")], _view(turn=7), {"turn"})
    assert problem and "holds 1 positions" in problem


def test_a_later_arrival_admitted_while_a_retracted_request_waits_breaks_r2() -> None:
    watch = _watch("a", "b", "late")
    watch.observe(1, [], _view(a=10, b=10), {"a", "b", "late"})
    assert watch.observe(2, [RetractEvent("b")], _view(a=11), {"a", "b", "late"}) is None
    assert watch.contested == 1  # "late" waited when "b" was retracted
    problem = watch.observe(3, [TokenEvent("late", (5,))], _view(a=11, late=8),
                            {"a", "b", "late"})
    assert problem and problem.startswith("R2") and "'late'" in problem and "'b'" in problem


def test_admitted_in_the_same_step_as_the_retracted_request_is_fine() -> None:
    watch = _watch("a", "b", "late")
    watch.observe(1, [], _view(a=10, b=10), {"a", "b", "late"})
    watch.observe(2, [RetractEvent("b")], _view(a=11), {"a", "b", "late"})
    assert watch.observe(3, [], _view(a=11, b=10, late=8), {"a", "b", "late"}) is None


def test_admission_is_read_from_a_streamed_token_too() -> None:
    """A later arrival that prefills and finishes in one step never shows in a view."""
    watch = _watch("a", "b", "late")
    watch.observe(1, [], _view(a=10, b=10), {"a", "b", "late"})
    watch.observe(2, [RetractEvent("b")], _view(a=11), {"a", "b", "late"})
    events: list[Event] = [TokenEvent("late", (5,)), FinishEvent("late", "length", (5,), "")]
    problem = watch.observe(3, events, _view(a=11), {"a", "b"})
    assert problem and problem.startswith("R2")


def test_a_reused_rid_starts_afresh() -> None:
    watch = _watch("a")
    watch.observe(1, [], _view(a=10), {"a"})
    watch.submitted("a", 0)  # aborted and submitted again before the next step
    assert watch.observe(2, [], _view(a=3), {"a"}) is None


def test_earlier_arrivals_and_other_retracted_requests_may_go_first() -> None:
    """R2 orders a retracted request only before first admissions of later arrivals: an
    earlier arrival's first admission, or another retracted request's re-admission, is not
    overtaking."""
    watch = _watch("early", "a", "b")
    watch.observe(1, [], _view(a=10, b=10), {"early", "a", "b"})
    watch.observe(2, [RetractEvent("a"), RetractEvent("b")], _view(), {"early", "a", "b"})
    assert watch.contested == 0
    assert watch.observe(3, [], _view(b=11), {"early", "a", "b"}) is None
    assert watch.observe(4, [], _view(b=11, early=3), {"early", "a", "b"}) is None


def test_a_listed_request_with_zero_kv_is_not_admitted() -> None:
    watch = _watch("a", "b", "late")
    watch.observe(1, [], _view(a=10, b=10, late=0), {"a", "b", "late"})
    assert watch.observe(2, [RetractEvent("b")], _view(a=11, b=0, late=0),
                         {"a", "b", "late"}) is None
    assert watch.contested == 1


# --- a toy scheduler over random loads --------------------------------------------------------


@dataclass
class ToyScheduler:
    """Admits the head of its queue when its whole context fits, else decodes every running
    request one token, retracting the newest while the pool cannot hold the step; a retracted
    request goes back at the front of the queue, or (``to_back``) at its back."""

    capacity: int
    to_back: bool = False
    prompts: dict[str, int] = field(default_factory=dict)
    want: dict[str, int] = field(default_factory=dict)
    output: dict[str, int] = field(default_factory=dict)
    waiting: deque[str] = field(default_factory=deque)
    running: dict[str, int] = field(default_factory=dict)  # rid -> KV held

    def submit(self, rid: str, prompt: int, new_tokens: int) -> None:
        self.prompts[rid], self.want[rid], self.output[rid] = prompt, new_tokens, 0
        self.waiting.append(rid)

    def step(self) -> list[Event]:
        if self.waiting:
            head = self.waiting[0]
            context = self.prompts[head] + self.output[head]
            if context + sum(self.running.values()) <= self.capacity:
                self.waiting.popleft()
                self.running[head] = context
                return self._emit([head])
        events: list[Event] = []
        while sum(self.running.values()) + len(self.running) > self.capacity:
            victim = max(self.running, key=list(self.prompts).index)
            del self.running[victim]
            events.append(RetractEvent(victim))
            self.waiting.append(victim) if self.to_back else self.waiting.appendleft(victim)
        for rid in self.running:
            self.running[rid] += 1
        return events + self._emit(list(self.running))

    def _emit(self, rids: list[str]) -> list[Event]:
        events: list[Event] = []
        for rid in rids:
            self.output[rid] += 1
            events.append(TokenEvent(rid, (0,)))
            if self.output[rid] == self.want[rid]:
                del self.running[rid]
                events.append(FinishEvent(rid, "length", (0,) * self.want[rid], ""))
        return events

    def view(self) -> MemoryView:
        return MemoryView(capacity=self.capacity, free=self.capacity - sum(self.running.values()),
                          held=0, page_size=1,
                          requests={rid: ReqKV(kv, kv) for rid, kv in self.running.items()})


Load = list[tuple[int, int, int]]  # (step it arrives at, prompt, new tokens)


def _run(load: Load, to_back: bool) -> tuple[str | None, int]:
    """Drive the toy scheduler through ``load``: the first rule broken (or None), and how many
    retractions had a later arrival waiting."""
    engine = ToyScheduler(capacity=40, to_back=to_back)
    watch, live = RetractionWatch(), set()
    arrivals = sorted(enumerate(load), key=lambda a: a[1][0])
    for step in range(1, 400):
        while arrivals and arrivals[0][1][0] < step:
            i, (_, prompt, new_tokens) = arrivals.pop(0)
            engine.submit(f"r{i}", prompt, new_tokens)
            watch.submitted(f"r{i}", 0)
            live.add(f"r{i}")
        events = engine.step()
        live -= {ev.rid for ev in events if isinstance(ev, FinishEvent)}
        problem = watch.observe(step, events, engine.view(), live)
        if problem:
            return problem, watch.contested
    assert not live, f"the toy scheduler did not finish: {sorted(live)}"
    return None, watch.contested


LOADS = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 12)),
                 min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(LOADS)
def test_front_requeue_never_breaks_the_rules(load: Load) -> None:
    assert _run(load, to_back=False)[0] is None


def test_back_requeue_is_caught_when_a_later_arrival_waits() -> None:
    # Three requests fill the pool; the fourth waits, and is still waiting when decoding needs
    # room and the newest running request is retracted.
    load = [(0, 12, 12), (0, 12, 12), (0, 12, 12), (0, 10, 4)]
    problem, contested = _run(load, to_back=False)  # the same load, re-queued at the front
    assert problem is None and contested > 0
    problem, _ = _run(load, to_back=True)
    assert problem and problem.startswith("R2 no overtaking")
