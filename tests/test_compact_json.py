"""``compact_json.dumps``: the same data as ``json.dumps`` writes, a list of numbers on one
line, and otherwise exactly ``json.dumps(indent=...)``'s layout."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.repro.compact_json import dumps

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=30)


def _holds_number_list(value: object) -> bool:
    if isinstance(value, dict):
        return any(map(_holds_number_list, value.values()))
    if isinstance(value, list):
        numbers = bool(value) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                      for v in value)
        return numbers or any(map(_holds_number_list, value))
    return False


@settings(max_examples=100, deadline=None)
@given(documents, st.integers(0, 3))
def test_it_loads_back_as_the_same_data(doc: object, indent: int) -> None:
    assert json.loads(dumps(doc, indent)) == doc


@settings(max_examples=100, deadline=None)
@given(documents)
def test_without_a_list_of_numbers_it_is_json_dumps_with_indent(doc: object) -> None:
    if not _holds_number_list(doc):
        assert dumps(doc) == json.dumps(doc, indent=1)


def test_a_list_of_numbers_is_one_line_inside_the_indented_structure() -> None:
    doc = {"runs": [{"prompt_ids": [5, 6, 7], "params": {}, "session": None}],
           "mixed": [1, "a"], "empty": []}
    assert dumps(doc) == (
        '{\n "runs": [\n  {\n   "prompt_ids": [5, 6, 7],\n   "params": {},\n'
        '   "session": null\n  }\n ],\n "mixed": [\n  1,\n  "a"\n ],\n "empty": []\n}')


def test_a_key_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(TypeError, match="keys must be strings"):
        dumps({1: "a"})
