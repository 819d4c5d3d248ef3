"""The drawn speculative shapes (``conformance.plan.shapes``): legal for the spec's algorithm,
distinct, none of the named ones, the same every time, and for a spec with trees first the
shapes named configurations never have (a tree of N = S + 1 that can branch, one of N = S·k,
a chain)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.plan.profiles import PROFILES
from conformance.plan.shapes import TREE_CLASSES, drawn_configs, drawn_shapes, legal_shapes
from conformance.plan.specs import SPECS, SpecChoice
from refengine.config import SpecConfig

SPECULATIVE = [s for s in SPECS.values() if s.configs[0] is not None]


def _has_trees(spec: SpecChoice) -> bool:
    return any(c is not None and c.topk > 1 for c in spec.configs)


@given(spec=st.sampled_from(SPECULATIVE), count=st.integers(0, 12))
def test_drawn_shapes_are_legal_new_and_distinct(spec: SpecChoice, count: int) -> None:
    configs = drawn_configs(spec, count)
    named = {(c.num_steps, c.topk, c.num_draft_tokens) for c in spec.configs if c is not None}
    shapes = [(c.num_steps, c.topk, c.num_draft_tokens) for c in configs]
    left = len(set(legal_shapes(_has_trees(spec))) - named)
    assert len(shapes) == min(count, left) == len(set(shapes))
    assert not set(shapes) & named
    base = spec.configs[0]
    assert base is not None
    for c in configs:
        # SpecConfig checks legality on construction; the rest is the spec's own
        assert SpecConfig(c.algorithm, c.draft_model, c.num_steps, c.topk, c.num_draft_tokens,
                          c.overlap) == c
        assert (c.algorithm, c.draft_model, c.overlap) == (base.algorithm, base.draft_model,
                                                           base.overlap)
        assert c.topk == 1 or _has_trees(spec), f"{spec.name} has chains only, drew {c}"


@pytest.mark.parametrize("spec", [s for s in SPECULATIVE if _has_trees(s)], ids=lambda s: s.name)
def test_a_tree_spec_draws_the_shapes_no_named_configuration_has(spec: SpecChoice) -> None:
    shapes = drawn_shapes(spec, PROFILES["gate"].drawn_shapes)
    assert len(shapes) == len(TREE_CLASSES)
    for shape, wanted in zip(shapes, TREE_CLASSES, strict=True):
        assert wanted(shape), shape
    (s, k, n), (s2, k2, n2), (_, chain_k, _) = shapes
    assert k > 1 and s >= 2 and n == s + 1
    assert k2 > 1 and n2 == s2 * k2
    assert chain_k == 1


def test_the_draw_is_the_same_every_time_and_the_gate_runs_the_full_profiles_first() -> None:
    for spec in SPECULATIVE:
        gate = drawn_shapes(spec, PROFILES["gate"].drawn_shapes)
        assert gate == drawn_shapes(spec, PROFILES["gate"].drawn_shapes)
        assert drawn_shapes(spec, PROFILES["full"].drawn_shapes)[:len(gate)] == gate


def test_plain_decoding_draws_nothing() -> None:
    assert drawn_configs(SPECS["none"], 6) == ()
