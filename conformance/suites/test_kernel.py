"""Tier kernel: the backend's tree kernels against the torch references, field by field.

A backend opts in by claiming the ``kernels`` capability and providing ``kernel_impls()``
(``conformance/contract/kernels.py``); without the claim every check is reported "not claimed".
Trees come from ``conformance.checks.tree_cases.tree_cases``: the drafter's candidate layout
with path scores that never rise along a path (ties included), selections by
``select_candidates``, and target predictions that follow a child about half of the time, so
accepted paths of every length, first-match among siblings and the depth cut all occur.

Example counts are small on purpose: on CPU these kernels run under Triton's interpreter, which
costs tens of milliseconds per launch; shapes are biased to the largest trees instead. A backend
whose kernels cannot run in this process (``KernelImpls.unavailable``) gets every check reported
not applicable, with its reason. Kernels on a CUDA device (``KernelImpls.device``, or the run's
``--device``) take every input there; the references run on the CPU, where the outputs are
compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conformance.checks.tree_cases import (
    TreeCase,
    published_greedy_vector,
    tree_cases,
)
from conformance.contract import KernelImpls
from conformance.run.context import SuiteContext
from refengine.kernels.tree_reference import (
    GreedyVerifyResult,
    Tree,
    build_tree_reference,
    verify_tree_greedy_reference,
)

pytestmark = [pytest.mark.specgate_tier("kernel"), pytest.mark.specgate_requires("kernels")]

# database=None: a certification run must not leave a .hypothesis directory behind
CASES = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])

TREE_FIELDS = ("tokens", "parents", "depth", "mask", "next_token", "next_sibling")
VERIFY_FIELDS = ("accept_index", "accept_len", "bonus")


def _impls(sg: SuiteContext, record_property: Callable[[str, object], None]) -> KernelImpls:
    hook = getattr(sg.backend, "kernel_impls", None)
    assert hook is not None, "the backend claims `kernels` but has no kernel_impls()"
    impls = hook()
    record_property("kernels", impls.name)  # which implementation was certified, in the results
    if impls.unavailable:
        pytest.skip(f"not applicable: the backend's {impls.name} kernels cannot run here: "
                    f"{impls.unavailable}")
    record_property("kernel_device", kernel_device(impls, sg.device))
    return impls


def kernel_device(impls: KernelImpls, run_device: str) -> str:
    """Where the kernels take their inputs: their own device, else the run's."""
    return impls.device if impls.device != "cpu" else run_device


def on_device(kernel: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``kernel`` called with its tensor arguments moved to ``device`` (as they are on the
    CPU)."""
    if device == "cpu":
        return kernel

    def call(*args: Any) -> Any:
        return kernel(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    return call


def _mismatches(got: Tree | GreedyVerifyResult, want: Tree | GreedyVerifyResult,
                fields: tuple[str, ...]) -> list[str]:
    """Fields that differ in shape or value. Integer width is not part of the contract (a GPU
    kernel may well use int32), so values are compared in the reference's dtype."""
    bad = []
    for name in fields:
        g, w = getattr(got, name), getattr(want, name)
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(w.shape):
            bad.append(f"{name}: shape {getattr(g, 'shape', type(g))}, expected {tuple(w.shape)}")
            continue
        g = g.detach().cpu().to(w.dtype)
        if not torch.equal(g, w):
            rows = (g != w).reshape(g.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            at = tuple((g != w).nonzero()[0].tolist()[:2])  # request row (and node, for mask)
            bad.append(f"{name}: rows {rows} differ; at {list(at)}: got {g[at].tolist()}, "
                       f"expected {w[at].tolist()}")
    return bad


def _verify(sg: SuiteContext, record_property: Callable) -> Callable[..., Any]:
    impls = _impls(sg, record_property)
    if impls.verify_greedy is None:
        pytest.skip("not claimed: verify_greedy")
    return on_device(impls.verify_greedy, kernel_device(impls, sg.device))


def _tree(case: TreeCase) -> Tree:
    return build_tree_reference(case.root, case.cand_tokens, case.cand_parents, case.selected)


def test_build_tree_matches_reference(sg: SuiteContext, record_property: Callable) -> None:
    impls = _impls(sg, record_property)
    if impls.build_tree is None:
        pytest.skip("not claimed: build_tree")
    build = on_device(impls.build_tree, kernel_device(impls, sg.device))

    @CASES
    @given(case=tree_cases())
    def check(case: TreeCase) -> None:
        got = build(case.root, case.cand_tokens, case.cand_parents, case.selected)
        bad = _mismatches(got, _tree(case), TREE_FIELDS)
        assert not bad, f"{case.describe()}: " + "; ".join(bad)

    check()


def test_verify_greedy_matches_reference(sg: SuiteContext, record_property: Callable) -> None:
    verify = _verify(sg, record_property)

    @CASES
    @given(case=tree_cases())
    def check(case: TreeCase) -> None:
        tree = _tree(case)
        args = (tree.tokens, tree.next_token, tree.next_sibling, case.target_predict,
                case.max_depth)
        bad = _mismatches(verify(*args), verify_tree_greedy_reference(*args), VERIFY_FIELDS)
        assert not bad, f"{case.describe()}: " + "; ".join(bad)

    check()


def test_verify_greedy_published_vector(sg: SuiteContext, record_property: Callable) -> None:
    """sgl-kernel's own vector: a sibling taken at depth 1, a stop at the depth limit (row 0)
    and a stop at a leaf (row 1); the sibling chains are not in node order here."""
    verify = _verify(sg, record_property)
    v = published_greedy_vector()
    got = verify(v.tokens, v.next_token, v.next_sibling, v.target_predict, v.max_depth)
    want = GreedyVerifyResult(v.accept_index, v.accept_len, v.bonus)
    bad = _mismatches(got, want, VERIFY_FIELDS)
    assert not bad, "; ".join(bad)
