"""What every compiled graph shares: the in-place KV write op, one code object per key, and
the inductor and Dynamo settings around a key's first and later calls.

The KV write must not be traced as an in-place update of the pool: functionalization turns it
into a copy of the whole pool per write. ``InPlaceKV`` writes through ``refengine::write_kv``
instead, an opaque op declared as mutating the pool, which inductor calls in place on the real
pool.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# A fragment library (not a new namespace) so another module may add ops under "refengine".
_LIB = torch.library.Library("refengine", "FRAGMENT")
_LIB.define("write_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, int layer, Tensor slots, "
            "Tensor k, Tensor v) -> ()")


def _write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
    # ``KVPool.write``'s own indexing: the compiled forward writes exactly what eager writes.
    k_pool[layer, slots] = k
    v_pool[layer, slots] = v


def _write_kv_fake(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                   slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    return None


# Registered through the plain library API rather than ``torch.library.custom_op``, whose
# Python wrappers cost more per call than the write itself.
_LIB.impl("write_kv", _write_kv, "CompositeExplicitAutograd")
torch.library.register_fake("refengine::write_kv", _write_kv_fake, lib=_LIB)


@dataclass
class InPlaceKV:
    """A pool's K and V (a ``KVCache``) whose writes go through ``refengine::write_kv``:
    built inside a compiled region from the pool's tensors, so a model's own forward runs
    there unchanged."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.ops.refengine.write_kv(self.k, self.v, layer, slots, k, v)


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled variants per code
    object and walks them in order on every call (and stops compiling past a limit of 8);
    giving each key its own copy keeps every cache at one entry, whatever the bucket count
    (one per torch thread count the key ran under, see ``WarmKeys``)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


# Weights folded into each key's code as constants, and the linear layers run by inductor's
# C++ GEMM templates on weights packed at compile time. The packed weights are mkldnn tensors,
# which the FX-graph cache cannot store, so every process compiles each key again, and each key
# holds its own packed copy of the weights.
FROZEN_WEIGHTS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


@contextmanager
def first_compile_settings(freeze_weights: bool = False) -> Iterator[None]:
    """Inductor settings for a key's first call, where it compiles (later calls run what was
    compiled): the FX-graph and AOT-autograd caches, so a key compiles once per machine, and
    the C++ wrapper, which calls the generated kernels from C++ instead of a Python function
    per graph. ``freeze_weights``: ``FROZEN_WEIGHTS`` too (the "frozen" executor)."""
    frozen = FROZEN_WEIGHTS if freeze_weights else {}
    with torch._inductor.config.patch(fx_graph_cache=True, cpp_wrapper=True, **frozen), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        yield


@contextmanager
def compiled_call_settings() -> Iterator[None]:
    """Settings for every call of a key after its first: Dynamo checks only the guards that
    tell one cached variant of a code object from another. ``own_code`` gives each key a
    single variant (per thread count, ``WarmKeys``), and a key is only ever called on what it
    was compiled for (the staged views, which never move, the model, the pool and the row
    table), so no guard it skips can fail."""
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        yield


class WarmKeys:
    """Which keys have run, under which torch thread count, and so which settings a call
    needs: a key's first call compiles (``first_compile_settings``), later ones skip the
    guards that cannot fail (``compiled_call_settings``). That skip is only safe while torch's
    global state is what the key was compiled under, and Dynamo refuses to recompile under it
    (RuntimeError). The part of that state a process changes in practice is the intra-op
    thread count (a C++ library loaded beside torch may set OpenMP's), so a call under a
    count not seen for its key goes through every guard instead: Dynamo compiles a variant
    for it, which then differs from the first by that guard."""

    def __init__(self, freeze_weights: bool) -> None:
        self.freeze_weights = freeze_weights
        self._warm: set[tuple[Hashable, int]] = set()

    @contextmanager
    def settings(self, key: Hashable) -> Iterator[None]:
        warm = (key, torch.get_num_threads())
        if warm in self._warm:
            with compiled_call_settings():
                yield
            return
        with first_compile_settings(self.freeze_weights):  # compilation happens here
            yield
        self._warm.add(warm)
