"""conformance.checks.distribution: exact laws of sampled tokens, and the negative control's law
(checked against the biased sampler itself, without an engine)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from conformance.backends.mutants.sampling import _residual_is_p
from conformance.checks.distribution import (
    JointLaw,
    SupportTooLarge,
    Trees,
    biased_bonus,
    draft_tree,
    emission,
    exact_law,
    first_draft_accept_rate,
    reference_bonus,
    speculative_law,
)
from conformance.checks.stats import gof_test
from refengine.speculative.verify import residual_without, verify_tree_sampling

VOCAB = 7
PROMPT = (1, 2)


def probs_of(ids: tuple[int, ...]) -> torch.Tensor:
    """A made-up target: a seeded distribution per sequence, with support size 2..4."""
    gen = torch.Generator().manual_seed(hash(ids) % (2**31))
    logits = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    k = 2 + len(ids) % 3
    kth = torch.topk(logits, k).values[-1]
    logits[logits < kth] = float("-inf")
    return torch.softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def law() -> JointLaw:
    return exact_law(probs_of, "p", PROMPT, 3)


def chain(*tokens: int) -> Counter:
    """A chain tree: root -> tokens[0] -> tokens[1] ..."""
    nodes = [(tuple(tokens[:i]), (tokens[i],)) for i in range(len(tokens))]
    nodes.append((tuple(tokens), ()))
    return Counter({tuple(sorted(nodes)): 1})


def some_trees(law: JointLaw) -> Trees:
    """Chains whose first draft is the most likely token (often accepted), a wide root, a
    draft outside the support, and roots with no record at all."""
    trees: Trees = {}
    for i, t1 in enumerate(sorted({c[0] for c in law.cells})):
        p1 = law.next_probs[(t1,)]
        top = int(torch.argmax(p1))
        if i == 0:
            trees[(*PROMPT, t1)] = chain(top, int(torch.argmax(law.next_probs[(t1, top)])))
        elif i == 1:
            s0, s1 = torch.nonzero(p1 > 0).flatten().tolist()[:2]
            wide = tuple(sorted([((), (s1, s0)), ((s0,), ()), ((s1,), ())]))
            trees[(*PROMPT, t1)] = Counter({wide: 2, next(iter(chain(top))): 1})
        elif i == 2:
            outside = int(torch.nonzero(p1 == 0).flatten()[0])
            trees[(*PROMPT, t1)] = chain(outside)
        for t2 in torch.nonzero(p1 > 0).flatten().tolist()[:1]:
            trees[(*PROMPT, t1, t2)] = chain(int(torch.argmax(law.next_probs[(t1, t2)])))
    return trees


def test_exact_law(law: JointLaw) -> None:
    assert law.probs.sum() == pytest.approx(1.0, abs=1e-12)
    assert all(p > 0 for p in law.probs)
    assert len(law.next_probs) == 1 + len({c[:1] for c in law.cells}) + len(
        {c[:2] for c in law.cells})
    t1, t2, t3 = law.cells[5]
    want = float(probs_of(PROMPT)[t1] * probs_of((*PROMPT, t1))[t2]
                 * probs_of((*PROMPT, t1, t2))[t3])
    assert law.probs[5] == pytest.approx(want, rel=1e-12)
    counts = law.counts([list(law.cells[0]), [*law.cells[0], 9], [VOCAB] * 3,
                         list(law.cells[5])])
    assert counts[0] == 2 and counts[5] == 1 and counts[-1] == 1
    assert 0 < law.entropy_bits < np.log2(len(law.cells)) + 1e-9


def test_reference_scheme_gives_the_target_law(law: JointLaw) -> None:
    trees = some_trees(law)
    np.testing.assert_allclose(speculative_law(law, trees, reference_bonus, 3), law.probs,
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(speculative_law(law, {}, biased_bonus, 3), law.probs,
                               rtol=1e-12, atol=1e-15)  # no drafts: nothing to bias


def test_biased_scheme_over_weights_drafts(law: JointLaw) -> None:
    trees = some_trees(law)
    p_alt = speculative_law(law, trees, biased_bonus, 3)
    assert p_alt.sum() == pytest.approx(1.0, abs=1e-12)
    t1 = sorted({c[0] for c in law.cells})[0]
    p1 = law.next_probs[(t1,)]
    d = int(torch.argmax(p1))
    marginal = sum(p for c, p in zip(law.cells, p_alt, strict=True) if c[:2] == (t1, d))
    p0 = float(law.next_probs[()][t1])
    assert marginal == pytest.approx(p0 * float(p1[d]) * (2 - float(p1[d])), rel=1e-12)
    assert 0.5 * np.abs(p_alt - law.probs).sum() > 0.01
    assert 0 < first_draft_accept_rate(law, trees, 3) < 1
    assert speculative_law(law, trees, biased_bonus, 0) == pytest.approx(law.probs)  # depth 0


def test_draft_tree_from_indices() -> None:
    # root(0) -> 1 (token 10), 2 (token 11); node 1 -> 3 (token 12)
    tree = draft_tree([5, 10, 11, 12], [1, 3, -1, -1], [-1, 2, -1, -1])
    assert dict(tree) == {(): (10, 11), (10,): (12,), (11,): (), (10, 12): ()}


@pytest.mark.parametrize("children", [(3,), (3, 1), (6,)])
def test_samplers_match_their_laws(children: tuple[int, ...]) -> None:
    """The first token the real samplers emit at a one-level tree follows ``emission``: the
    reference sampler gives ``p``, the negative control's gives the biased law."""
    p = torch.tensor([0.05, 0.25, 0.0, 0.4, 0.2, 0.1, 0.0], dtype=torch.float64)
    tokens = [9, *children]
    next_token = [1 if children else -1] + [-1] * len(children)
    next_sibling = [-1] + [i + 2 for i in range(len(children) - 1)] + [-1]
    probs = p.expand(len(tokens), -1)
    for residual, bonus in ((residual_without, reference_bonus),
                            (_residual_is_p, biased_bonus)):
        counts = np.zeros(len(p))
        for seed in range(3000):
            path = verify_tree_sampling(tokens, next_token, next_sibling, probs, 1, seed, 0,
                                        residual=residual)
            first = tokens[path.nodes[1]] if len(path.nodes) > 1 else path.bonus
            counts[first] += 1
        accepted, rest = emission(p, children, bonus)
        want = (accepted + rest).numpy()
        result = gof_test(counts, want)
        assert not result.rejected, (residual.__name__, result.summary())
        if bonus is biased_bonus:  # visibly biased unless no child has mass
            assert gof_test(counts, p.numpy()).rejected == (float(p[list(children)].sum()) > 0)
    biased = sum(emission(p, (3,), biased_bonus))
    assert float(biased[3]) == pytest.approx(0.4 * 1.6)


def test_exact_law_stops_past_max_cells(law: JointLaw) -> None:
    walked: list[tuple[int, ...]] = []

    def counting(ids: tuple[int, ...]) -> torch.Tensor:
        walked.append(ids)
        return probs_of(ids)

    assert exact_law(probs_of, "p", PROMPT, 3, max_cells=len(law.cells)).cells == law.cells
    with pytest.raises(SupportTooLarge):
        exact_law(counting, "p", PROMPT, 3, max_cells=4)
    assert len(walked) <= 2 * 4 + 1  # every prefix walked leads to a cell
