"""The Triton tree kernels against the torch references.

Running the kernels needs a GPU or Triton's CPU interpreter (``TRITON_INTERPRET=1``, as the
tox env ``kernels`` sets); elsewhere those tests skip. Three checks run everywhere: the
wrappers refuse to run where Triton cannot (rather than fall back to the references), importing
the kernel hook (even choosing the kernels) does not import Triton, and — when Triton is
installed — both kernels compile for a CUDA target, which the (lenient) interpreter alone would
not prove.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from conformance.checks.tree_cases import (
    ORPHAN_ERROR,
    TreeCase,
    orphan_tree_args,
    published_greedy_vector,
    tree_cases,
)
from refengine.kernels.tree_reference import (
    build_tree_reference,
    verify_tree_greedy_reference,
)
from refengine.kernels.tree_triton import (
    NOT_RUNNABLE,
    build_tree_triton,
    interpreter_enabled,
    triton_runnable,
    verify_tree_greedy_triton,
)

needs_triton_runtime = pytest.mark.skipif(
    not triton_runnable(), reason="Triton kernels need a GPU or TRITON_INTERPRET=1 "
                                  "(run the tox env `kernels`)")

# interpreted launches cost tens of milliseconds: a few examples, biased to large trees
FEW = settings(max_examples=20, deadline=None, derandomize=True, database=None)

TREE_FIELDS = ("tokens", "parents", "depth", "mask", "next_token", "next_sibling")


def on_kernel_device(*args: object) -> tuple[object, ...]:
    """The kernels' arguments where they run: the CPU under the interpreter, else the GPU
    (compiled Triton reads device memory only); the references keep theirs on the CPU."""
    device = "cpu" if interpreter_enabled() else "cuda"
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _assert_same(got: object, want: object, fields: tuple[str, ...]) -> None:
    for name in fields:
        g, w = getattr(got, name).cpu(), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape)
        assert torch.equal(g, w), (name, g, w)


@needs_triton_runtime
def test_published_vector() -> None:
    v = published_greedy_vector()
    got = verify_tree_greedy_triton(*on_kernel_device(v.tokens, v.next_token, v.next_sibling,
                                                      v.target_predict, v.max_depth))
    assert got.accept_index.tolist() == v.accept_index.tolist()
    assert got.accept_len.tolist() == v.accept_len.tolist()
    assert got.bonus.tolist() == v.bonus.tolist()


@needs_triton_runtime
@FEW
@given(case=tree_cases())
def test_build_matches_reference(case: TreeCase) -> None:
    args = (case.root, case.cand_tokens, case.cand_parents, case.selected)
    _assert_same(build_tree_triton(*on_kernel_device(*args)), build_tree_reference(*args),
                 TREE_FIELDS)


@needs_triton_runtime
@FEW
@given(case=tree_cases())
def test_verify_matches_reference(case: TreeCase) -> None:
    tree = build_tree_reference(case.root, case.cand_tokens, case.cand_parents, case.selected)
    args = (tree.tokens, tree.next_token, tree.next_sibling, case.target_predict,
            case.max_depth)
    _assert_same(verify_tree_greedy_triton(*on_kernel_device(*args)),
                 verify_tree_greedy_reference(*args), ("accept_index", "accept_len", "bonus"))


@needs_triton_runtime
def test_int32_inputs_and_empty_batch() -> None:
    """Index and token dtypes other than int64 (a GPU engine's choice) and b = 0."""
    root = torch.tensor([9, 8], dtype=torch.int32)
    cand_tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], dtype=torch.int32)
    cand_parents = torch.tensor([[-1, -1, 0, 0, 1, 1]] * 2, dtype=torch.int32)
    selected = torch.tensor([[0, 1, 2, 4], [0, 1, 3, 5]], dtype=torch.int32)
    args = (root, cand_tokens, cand_parents, selected)
    _assert_same(build_tree_triton(*on_kernel_device(*args)), build_tree_reference(*args),
                 TREE_FIELDS)
    empty = (root[:0], cand_tokens[:0], cand_parents[:0], selected[:0])
    _assert_same(build_tree_triton(*on_kernel_device(*empty)), build_tree_reference(*empty),
                 TREE_FIELDS)


@needs_triton_runtime
def test_build_rejects_a_node_without_its_parent() -> None:
    with pytest.raises(ValueError, match=ORPHAN_ERROR):
        build_tree_triton(*on_kernel_device(*orphan_tree_args()))


def test_refuses_to_run_without_gpu_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    v = published_greedy_vector()
    with pytest.raises(RuntimeError, match=NOT_RUNNABLE):
        verify_tree_greedy_triton(v.tokens, v.next_token, v.next_sibling, v.target_predict,
                                  v.max_depth)
    with pytest.raises(RuntimeError, match=NOT_RUNNABLE):
        build_tree_triton(torch.tensor([1]), torch.tensor([[2]]), torch.tensor([[-1]]),
                          torch.tensor([[0]]))


def test_importing_the_hook_does_not_import_triton() -> None:
    code = ("import sys, conformance.backends.refengine.kernels as k; "
            "k.default_kernels_for_refengine(); "
            "assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# Run in a fresh interpreter without TRITON_INTERPRET: once Triton has been imported with the
# interpreter on, its own library functions are interpreted ones and nothing can be compiled.
_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from refengine.kernels import tree_triton

tree_triton.tl = triton.language
ptrs = ("root_ptr", "cand_tokens_ptr", "cand_parents_ptr", "selected_ptr", "tokens_ptr",
        "parents_ptr", "depth_ptr", "next_token_ptr", "next_sibling_ptr")
build_sig = {name: "*i64" for name in ptrs}
build_sig |= {"mask_ptr": "*u8", "C": "i32", "N": "i32", "NB": "constexpr"}
verify_sig = {name: "*i64" for name in ("tokens_ptr", "next_token_ptr", "next_sibling_ptr",
                                        "target_ptr", "accept_index_ptr", "accept_len_ptr",
                                        "bonus_ptr")}
verify_sig |= {"N": "i32", "max_depth": "i32"}
for fn, sig, consts in ((tree_triton._build_tree_kernel, build_sig, {"NB": 16}),
                        (tree_triton._verify_greedy_kernel, verify_sig, {})):
    src = ASTSource(fn=JITFunction(fn), signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32))
    assert "ttir" in compiled.asm, fn.__name__
"""


def test_kernels_compile_for_a_cuda_target(tmp_path: Path) -> None:
    """Lower both kernels through Triton's CUDA pipeline (sm_80) without a GPU: the
    interpreter accepts Python the compiler rejects (types of loop-carried values, 0-d
    tensors), so this is the check that the kernels are real Triton."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
