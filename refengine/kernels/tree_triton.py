"""Triton kernels for the tree build and greedy tree verify, checked against the torch references.

The engine runs them, compiled, when its tensors are on a CUDA device, and the torch references
(``tree_reference.py``) everywhere else (``dispatch.tree_kernels``); both meet the same oracle.
On CPU the kernels run only under Triton's interpreter, for the kernel tests
(``TRITON_INTERPRET=1``, set before Triton is first imported in the process: Triton jits its own
library functions at import, in whichever mode is on then); without a GPU or the interpreter
the wrappers raise ``RuntimeError`` rather than fall back silently, so a test that asked for
Triton never passes on the reference by accident. Triton is imported lazily: importing this
module never needs Triton.

Layout (both kernels): one program per request row, every tensor contiguous and row-major, so a
row's data sits at ``row * width``. Node 0 is the root; nodes 1..N-1 are the selected candidates
in ascending flat order (see ``tree_reference`` for the candidate layout).

* Build: every per-node quantity is a vector of ``NB >= N`` lanes (lane = node index) held in
  registers. Parents come from one ``[NB, NB]`` comparison of each node's flat parent against
  the selected flat indices; first child and next sibling are the smallest later node with the
  right parent, which is exactly the ascending sibling order the reference builds by pushing at
  the head. The ancestor mask needs the parents' rows first, so it is one scalar loop in node
  order (a parent always precedes its child); depth is the mask's row count minus one. A node
  whose parent was not selected gets parent -1, and the wrapper raises the reference's error.
* Verify: a scalar walk. Per depth, the children are scanned along ``next_sibling`` until one
  carries the target's token (the scan is bounded by N, so a malformed sibling chain cannot
  hang the kernel); a miss ends the walk. Nothing the kernel writes is read back, so there is
  no intra-program store/load ordering to worry about.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from refengine.kernels.tree_reference import GreedyVerifyResult, Tree

NOT_RUNNABLE = "triton kernels need a GPU or TRITON_INTERPRET=1"

# ``triton.language``, bound by ``_kernels()``. The kernel bodies below are plain functions that
# name ``tl`` as a module global, so they can be defined without Triton and jitted on first use
# (Triton decides interpreter vs compiler when a function is jitted, i.e. then).
tl: Any = None

_TRUE = ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET`` is set to a true value (Triton's own reading of the variable)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_runnable() -> bool:
    """Triton is installed and can execute here: a CUDA device, or the CPU interpreter.
    (Checked without importing Triton, so asking is cheap and has no side effects.)"""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreter_enabled() or torch.cuda.is_available()


def _build_tree_kernel(root_ptr, cand_tokens_ptr, cand_parents_ptr, selected_ptr,
                       tokens_ptr, parents_ptr, depth_ptr, mask_ptr, next_token_ptr,
                       next_sibling_ptr, C, N, NB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NB)
    valid = idx < N
    draft = valid & (idx >= 1)
    # node i >= 1 is selected[r, i - 1]
    sel = tl.load(selected_ptr + r * (N - 1) + idx - 1, mask=draft, other=0)
    cand = tl.load(cand_tokens_ptr + r * C + sel, mask=draft, other=0)
    root = tl.load(root_ptr + r)
    tl.store(tokens_ptr + r * N + idx, tl.where(idx == 0, root, cand), mask=valid)

    # parent: the node holding my flat parent (flat -1: the root; not selected: -1, an error)
    flat_parent = tl.load(cand_parents_ptr + r * C + sel, mask=draft, other=-1)
    holds = (sel[None, :] == flat_parent[:, None]) & draft[None, :]          # [i, j]
    parent = tl.max(tl.where(holds, idx[None, :], -1), axis=1)
    parent = tl.where(flat_parent < 0, 0, parent)
    parent = tl.where(draft, parent, -1)
    tl.store(parents_ptr + r * N + idx, parent, mask=valid)

    # first child / next sibling: the smallest (later) node with the right parent
    child_of = (parent[None, :] == idx[:, None]) & draft[None, :]            # j is i's child
    first = tl.min(tl.where(child_of, idx[None, :], NB), axis=1)
    tl.store(next_token_ptr + r * N + idx, tl.where(first < NB, first, -1), mask=valid)
    later_sibling = ((parent[None, :] == parent[:, None]) & draft[None, :] & draft[:, None]
                     & (idx[None, :] > idx[:, None]))
    sibling = tl.min(tl.where(later_sibling, idx[None, :], NB), axis=1)
    tl.store(next_sibling_ptr + r * N + idx, tl.where(sibling < NB, sibling, -1), mask=valid)

    # mask row i = mask row parent(i) plus i itself; rows in node order, parents first
    rows = idx[:, None]
    cols = idx[None, :]
    mask = tl.where((rows == cols) & valid[:, None], 1, 0)
    for i in range(1, N):
        p = tl.sum(tl.where(idx == i, parent, 0), axis=0)
        above = tl.max(tl.where(rows == p, mask, 0), axis=0)                 # row p
        mask = tl.where(rows == i, tl.maximum(mask, above[None, :]), mask)
    both = valid[:, None] & valid[None, :]
    tl.store(mask_ptr + r * N * N + rows * N + cols, mask, mask=both)
    tl.store(depth_ptr + r * N + idx, tl.sum(mask, axis=1) - 1, mask=valid)


def _verify_greedy_kernel(tokens_ptr, next_token_ptr, next_sibling_ptr, target_ptr,
                          accept_index_ptr, accept_len_ptr, bonus_ptr, N, max_depth):
    r = tl.program_id(0).to(tl.int64)
    row = r * N
    out = r * (max_depth + 1)
    last = tl.zeros((), dtype=tl.int64)
    accepted = tl.zeros((), dtype=tl.int64)
    alive = tl.full((), 1, dtype=tl.int1)
    tl.store(accept_index_ptr + out, last)
    for _ in range(max_depth):
        want = tl.load(target_ptr + row + last)
        child = tl.load(next_token_ptr + row + last).to(tl.int64)
        child = tl.where(alive, child, -1)
        token = tl.load(tokens_ptr + row + child, mask=child >= 0, other=want)
        hops = 0
        while (token != want) & (hops < N):
            child = tl.load(next_sibling_ptr + row + child).to(tl.int64)
            token = tl.load(tokens_ptr + row + child, mask=child >= 0, other=want)
            hops += 1
        hit = (child >= 0) & (token == want)
        accepted += hit.to(tl.int64)
        tl.store(accept_index_ptr + out + accepted, child, mask=hit)
        last = tl.where(hit, child, last)
        alive = alive & hit
    tl.store(accept_len_ptr + r, accepted)
    tl.store(bonus_ptr + r, tl.load(target_ptr + row + last))


_KERNELS: dict[bool, tuple[Any, Any]] = {}


def _kernels() -> tuple[Any, Any]:
    """The jitted kernels for the current mode (interpreter or compiler), jitted once each."""
    if not triton_runnable():
        raise RuntimeError(NOT_RUNNABLE)
    global tl
    mode = interpreter_enabled()
    if mode not in _KERNELS:
        import triton
        import triton.language as language

        tl = language
        _KERNELS[mode] = (triton.jit(_build_tree_kernel), triton.jit(_verify_greedy_kernel))
    return _KERNELS[mode]


def _block(n: int) -> int:
    """Lanes per node vector: a power of two (Triton's ``arange`` needs one), at least 16."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def build_tree_triton(root: torch.Tensor, cand_tokens: torch.Tensor,
                      cand_parents: torch.Tensor, selected: torch.Tensor) -> Tree:
    """Same contract and outputs as ``build_tree_reference`` (dtypes included)."""
    build, _ = _kernels()
    b, n = root.shape[0], selected.shape[1] + 1
    device = root.device
    tokens = torch.empty((b, n), dtype=torch.promote_types(root.dtype, cand_tokens.dtype),
                         device=device)
    parents, depth, next_token, next_sibling = (
        torch.empty((b, n), dtype=torch.int64, device=device) for _ in range(4))
    mask = torch.zeros((b, n, n), dtype=torch.bool, device=device)
    if b:
        build[(b,)](root.contiguous(), cand_tokens.contiguous(), cand_parents.contiguous(),
                    selected.contiguous(), tokens, parents, depth, mask.view(torch.uint8),
                    next_token, next_sibling, cand_tokens.shape[1], n, NB=_block(n))
        orphans = (parents[:, 1:] < 0).nonzero()
        if orphans.numel():
            r, i = orphans[0].tolist()
            raise ValueError(f"request row {r}: node {i + 1} selected without its parent")
    return Tree(tokens, parents, depth, mask, next_token, next_sibling)


def verify_tree_greedy_triton(tokens: torch.Tensor, next_token: torch.Tensor,
                              next_sibling: torch.Tensor, target_predict: torch.Tensor,
                              max_depth: int) -> GreedyVerifyResult:
    """Same contract and outputs as ``verify_tree_greedy_reference``."""
    _, verify = _kernels()
    b, n = tokens.shape
    device = tokens.device
    accept_index = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_len = torch.zeros(b, dtype=torch.int64, device=device)
    bonus = torch.zeros(b, dtype=torch.int64, device=device)
    if b:
        verify[(b,)](tokens.contiguous(), next_token.contiguous(), next_sibling.contiguous(),
                     target_predict.contiguous(), accept_index, accept_len, bonus, n, max_depth)
    return GreedyVerifyResult(accept_index, accept_len, bonus)
