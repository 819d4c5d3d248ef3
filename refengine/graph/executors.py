"""Executors: what runs a staged forward for one graph key (kind, bucket, key width).

``ReplayExecutor`` calls the captured forward callable on the padded static views, eagerly:
the same code as an eager step, only on padded fixed-size inputs, which is what the property
tests need to check staging, padding and slicing on CPU.

``CompiledExecutor`` removes per-op overhead on CPU with ``torch.compile`` (inductor, static
shapes, one compile per key). The KV-cache write must not be traced as an in-place update of
the pool: functionalization turns it into a copy of the whole pool per write (measured here:
~190 ms a batch-1 step instead of ~10 ms eager). Two ways around it:

* ``split="whole"`` (default): one compiled region for the whole forward; the write is the
  opaque custom op ``refengine::write_kv``, declared as mutating the pool, which inductor
  calls in place on the real pool (no copy; the profiler shows 12 op calls a step and no
  pool-sized work).
* ``split="layers"``: regions between the writes ("attention and MLP of layer l-1, then norm,
  projections and RoPE of layer l") and eager writes between them. No custom op, but one
  compiled call per layer, and on CPU each call has a fixed cost (guards, wrappers: ~60-100 us
  here) that eats most of what fusing saves.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from refengine.graph.staging import StagedViews, static_attention
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata, paged_attention
from refengine.model.llama import (
    DecoderLayer,
    ForwardOutput,
    LlamaForCausalLM,
    RMSNorm,
    RopeAt,
    Rotary,
)

# The KV write as an opaque op that mutates the pool in place. A fragment library (not a new
# namespace) so another module may add ops under "refengine" too.
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


# Registered through the plain library API rather than ``torch.library.custom_op``: the latter's
# Python wrappers cost ~80 us a call here, against ~30 us for this and ~10 us for the bare write.
_LIB.impl("write_kv", _write_kv, "CompositeExplicitAutograd")
torch.library.register_fake("refengine::write_kv", _write_kv_fake, lib=_LIB)


class GraphKey(NamedTuple):
    kind: str     # "decode" or "verify"
    bucket: int   # padded batch size (requests)
    max_kv: int   # key columns every request's attention spans


class Executor(Protocol):
    name: str
    # True when the returned tensors live in executor-owned memory that the next run
    # overwrites (a CUDA graph's output pool): the runner must copy them out.
    outputs_persist: bool

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        """Capture or compile ``key`` (``views`` hold a batch of padding only)."""

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        """The forward of the staged bucket: ``bucket * q`` rows of logits and features."""


StaticForward = Callable[[GraphKey, StagedViews], ForwardOutput]


class ReplayExecutor:
    """Runs the captured callable (the model's own forward over the static views) eagerly."""

    name = "replay"
    outputs_persist = False  # every call allocates its outputs

    def __init__(self, forward: StaticForward) -> None:
        self.forward = forward

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        self.forward(key, views)  # nothing to capture on CPU; runs the padding-only batch once

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        return self.forward(key, views)


# --- the regions of the compiled forward -------------------------------------------------------
# They restate the model's per-layer code around its cache write (``Attention.forward`` writes
# in the middle of its body); the replay-vs-compiled tests with the "eager" backend check they
# stay bit-identical to the model.


def _project(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer input -> (q, k, v) with RoPE applied, as ``Attention.forward`` computes them."""
    attn, n, rope = layer.self_attn, x.shape[0], RopeAt(cos, sin)
    h = layer.input_layernorm(x)
    q = rope.apply(attn.q_proj(h).view(n, attn.heads, attn.head_dim))
    k = rope.apply(attn.k_proj(h).view(n, attn.kv_heads, attn.head_dim))
    return q, k, attn.v_proj(h).view(n, attn.kv_heads, attn.head_dim)


def _finish_layer(layer: DecoderLayer, x: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor
                  ) -> torch.Tensor:
    """Attention over the (already written) cache, output projection, residual, MLP."""
    attn = layer.self_attn
    out = paged_attention(q, k_cache, v_cache, AttentionMetadata(kv_slots, mask),
                          attn.head_dim ** -0.5)
    x = attn.o_proj(out.flatten(1)) + x
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _head_region(embed: nn.Embedding, rotary: Rotary, first: DecoderLayer,
                 input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 seq_lens: torch.Tensor, tree_mask: torch.Tensor, table: torch.Tensor,
                 max_kv: int) -> tuple[torch.Tensor, ...]:
    # Tensors only (no StagedViews): Dynamo would specialise on its ints (the raw size).
    x = embed(input_ids)
    rope = rotary.at(positions, x.dtype)
    meta = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    q, k, v = _project(first, x, rope.cos, rope.sin)
    return x, rope.cos, rope.sin, meta.kv_slots, meta.mask, q, k, v


def _middle_region(layer: DecoderLayer, following: DecoderLayer, x: torch.Tensor,
                   q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    x = _finish_layer(layer, x, q, k_cache, v_cache, kv_slots, mask)
    return (x, *_project(following, x, cos, sin))


def _tail_region(last: DecoderLayer, norm: RMSNorm, lm_head: nn.Linear, x: torch.Tensor,
                 q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_slots: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    features = norm(_finish_layer(last, x, q, k_cache, v_cache, kv_slots, mask))
    return lm_head(features).float(), features


def _whole_forward(model: LlamaForCausalLM, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                   rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                   table: torch.Tensor, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward with every write through ``refengine::write_kv``."""
    x = model.model.embed_tokens(input_ids)
    rope = model.rotary.at(positions, x.dtype)
    meta = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    for i, layer in enumerate(model.model.layers):
        q, k, v = _project(layer, x, rope.cos, rope.sin)
        torch.ops.refengine.write_kv(k_pool, v_pool, i, out_slots, k, v)
        x = _finish_layer(layer, x, q, k_pool[i], v_pool[i], meta.kv_slots, meta.mask)
    features = model.model.norm(x)
    return model.lm_head(features).float(), features


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object. Dynamo keeps compiled variants per code
    object and walks them in order on every call (and stops compiling past a limit of 8);
    giving each key its own copy keeps every cache at one entry, whatever the bucket count
    (one per torch thread count the key ran under, see ``WarmKeys``)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


# Weights folded into each key's code as constants and the linear layers run by inductor's C++
# GEMM templates on weights packed at compile time. Measured on tiny-code, one thread, batch 1,
# context 128, key width 192 (five rounds of 100 steps; ms a step): decode 1.36-1.62 -> 0.87-0.92,
# verify N=4 2.16-2.23 -> 1.12-1.15, logits within 5e-6 of eager, argmax equal. The packed
# weights are mkldnn tensors, which the FX-graph cache cannot store, so every process compiles
# each key again (about 35 s a key here, against 15 s cold and under 2 s cached for
# "compiled"), and each key holds its own packed copy of the weights.
FROZEN_WEIGHTS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


@contextmanager
def first_compile_settings(freeze_weights: bool = False) -> Iterator[None]:
    """Inductor settings for a key's first call, where it compiles (later calls run what was
    compiled): the FX-graph and AOT-autograd caches, so a key compiles once per machine, and
    the C++ wrapper, which calls the generated kernels from C++ instead of a Python function
    per graph. Measured on tiny-code at batch 1, `specgate bench --spec eagle --graphs
    compiled`, Python and C++ wrapper alternating, two runs each, warm caches (tok/s): plain
    569/593 -> 627/644, EAGLE chain S3/N4 635/625 -> 659/664, tree 666/672 -> 723/718 (+5 to
    +8 %). A cold first compile of a batch-1 decode key took 15.4 s; a cached one loads in
    under 2 s. ``freeze_weights``: ``FROZEN_WEIGHTS`` too (the "frozen" executor)."""
    frozen = FROZEN_WEIGHTS if freeze_weights else {}
    with torch._inductor.config.patch(fx_graph_cache=True, cpp_wrapper=True, **frozen), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        yield


@contextmanager
def compiled_call_settings() -> Iterator[None]:
    """Settings for every call of a key after its first: Dynamo checks only the guards that
    tell one cached variant of a code object from another. ``_own_code`` gives each key a
    single variant (per thread count, ``WarmKeys``), and a key is only ever called on what it
    was compiled for (the staged views, which never move, the model, the pool and the row
    table), so no guard it skips can fail. The guards it skips cost 0.15-0.3 ms a call:
    measured on tiny-code, one thread, batch 1, context 128, compiled forward steps with and
    without (five rounds of 100 steps, taking turns; ms a step): decode 2.35-2.89 ->
    2.16-2.43, verify N=4 3.26-3.39 -> 2.90-3.06."""
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


@dataclass
class _Regions:
    head: Callable[..., Any]
    middle: Callable[..., Any]
    tail: Callable[..., Any]


class CompiledExecutor:
    """``torch.compile`` per key (``fullgraph=True``, ``dynamic=False``), the KV writes never
    traced as pool updates (see the module docstring for ``split``).

    The inductor FX-graph and AOT-autograd caches are switched on around compilation, so a
    key compiled once on a machine (cache directory ``TORCHINDUCTOR_CACHE_DIR``, by default
    under the temp directory) only pays Dynamo tracing and a cache load in later processes.
    ``backend="eager"`` generates no code (Dynamo traces, the graph runs as plain torch): the
    tests use it to check the compiled forward restates the model exactly.
    ``freeze_weights`` (the "frozen" executor, see ``FROZEN_WEIGHTS``): faster keys that every
    process compiles again; the model's weights must not change after a key is compiled.
    """

    outputs_persist = False  # inductor allocates outputs per call

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, table: torch.Tensor,
                 backend: str = "inductor", split: Literal["whole", "layers"] = "whole",
                 freeze_weights: bool = False) -> None:
        if split not in ("whole", "layers"):
            raise ValueError(f"split: 'whole' or 'layers', got {split!r}")
        self.model, self.kv, self.table = model, kv, table
        self.backend, self.split, self.freeze_weights = backend, split, freeze_weights
        self.name = "frozen" if freeze_weights else "compiled"
        self._whole: dict[GraphKey, Callable[..., Any]] = {}
        self._regions: dict[GraphKey, _Regions] = {}
        self._warm = WarmKeys(freeze_weights)

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(_own_code(fn), backend=self.backend, fullgraph=True, dynamic=False)

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        self.run(key, views)

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        if self.split == "whole" and key not in self._whole:
            self._whole[key] = self._compile(_whole_forward)
        elif self.split == "layers" and key not in self._regions:
            self._regions[key] = _Regions(self._compile(_head_region),
                                          self._compile(_middle_region),
                                          self._compile(_tail_region))
        with self._warm.settings(key):
            return self._run(key, views)

    def _run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        with torch.inference_mode():
            if self.split == "whole":
                logits, features = self._whole[key](
                    self.model, self.kv.k, self.kv.v, views.input_ids, views.positions,
                    views.out_slots, views.rows, views.seq_lens, views.tree_mask, self.table,
                    key.max_kv)
            else:
                logits, features = self._run_layers(self._regions[key], key, views)
        return ForwardOutput(logits, features)

    def _run_layers(self, regions: _Regions, key: GraphKey, views: StagedViews
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        model, kv = self.model, self.kv
        layers = model.model.layers
        x, cos, sin, kv_slots, mask, q, k, v = regions.head(
            model.model.embed_tokens, model.rotary, layers[0], views.input_ids,
            views.positions, views.rows, views.seq_lens, views.tree_mask, self.table,
            key.max_kv)
        last = len(layers) - 1
        for i in range(last):
            kv.write(i, views.out_slots, k, v)  # eager, between two compiled regions
            x, q, k, v = regions.middle(layers[i], layers[i + 1], x, q, cos, sin,
                                        kv.k[i], kv.v[i], kv_slots, mask)
        kv.write(last, views.out_slots, k, v)
        return regions.tail(layers[last], model.model.norm, model.lm_head, x, q,
                            kv.k[last], kv.v[last], kv_slots, mask)
