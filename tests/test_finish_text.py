"""The oracle's finish text for a request that ended by ``stop`` (``ReferenceOracle.finish_text``,
what the lifecycle tier and the replay expect): the output's text cut just before the earliest
stop string in it, whichever is listed first; whole where none occurs."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.checks.oracle import ReferenceOracle
from conformance.plan.prompts import load_prompt_set


@cache
def oracle() -> ReferenceOracle:
    return ReferenceOracle("tiny-code", expected=None)


@cache
def stream() -> tuple[int, ...]:
    """Real code tokens to decode: the small prompt set's, one after another."""
    return tuple(t for case in load_prompt_set("small") for t in case.ids)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], tuple[str, ...]]:
    """A stretch of tokens, and up to three stop strings: pieces of its text (so they occur)
    or text that may not, in drawn order."""
    start = draw(st.integers(0, len(stream()) - 40))
    ids = list(stream()[start:start + draw(st.integers(1, 40))])
    text = oracle().decode(ids)
    piece = st.integers(0, max(len(text) - 1, 0)).flatmap(
        lambda i: st.integers(i + 1, i + 6).map(lambda j: text[i:j]))
    stops = draw(st.lists(st.one_of(piece, st.text(min_size=1, max_size=4)), min_size=1,
                          max_size=3))
    return ids, tuple(s for s in stops if s)


@settings(max_examples=200, deadline=None)
@given(case=cases(), data=st.data())
def test_cut_before_the_earliest_stop_string_in_any_order(
        case: tuple[list[int], tuple[str, ...]], data: st.DataObject) -> None:
    ids, stops = case
    text, got = oracle().decode(ids), oracle().finish_text(ids, stops)
    assert text.startswith(got)
    # no stop string starts before the cut (not even one running past it)
    assert all(text.find(s) < 0 or text.find(s) >= len(got) for s in stops)
    found = any(s in text for s in stops)
    assert got == text if not found else any(text[len(got):].startswith(s) for s in stops)
    assert oracle().finish_text(ids, tuple(data.draw(st.permutations(stops)))) == got


def test_the_first_listed_string_is_not_where_the_text_is_cut() -> None:
    ids = list(stream()[:12])
    text = oracle().decode(ids)
    late, early = text[-3:], text[-5:]  # both end the text; ``early`` starts two before
    assert 0 <= text.find(early) < text.find(late), (text, late, early)
    assert oracle().finish_text(ids, (late, early)) == text[:text.find(early)]
