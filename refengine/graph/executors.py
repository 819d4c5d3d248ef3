"""Executors: what runs a staged forward for one graph key (kind, bucket, key width).

``ReplayExecutor`` calls the captured forward callable on the padded static views, eagerly:
the same code as an eager step, only on padded fixed-size inputs, which is what the property
tests need to check staging, padding and slicing on CPU.

``CompiledExecutor`` removes per-op overhead on CPU with ``torch.compile`` (inductor, static
shapes, one compile per key), the KV writes kept out of the traced pool updates
(``compile.py``), in one of two ways:

* ``split="whole"`` (default): one compiled region for the model's whole forward, its writes
  through the in-place op ``refengine::write_kv``.
* ``split="layers"``: regions between the writes ("attention and MLP of layer l-1, then norm,
  projections and RoPE of layer l") and eager writes between them. No custom op, but one
  compiled call per layer, each with a fixed cost on CPU (guards, wrappers) that eats most of
  what fusing saves.

Both compose the model's own pieces (``LlamaForCausalLM.embed``/``features``/``logits``,
``DecoderLayer.project``/``finish``); the replay-vs-compiled tests with the "eager" backend
check they give the model's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch

from refengine.graph.compile import InPlaceKV, WarmKeys, own_code
from refengine.graph.staging import StagedViews, static_attention
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.llama import DecoderLayer, ForwardOutput, LlamaForCausalLM, RopeAt


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


# --- what the compiled executor compiles ------------------------------------------------------
# Tensors (and modules) only as arguments, no StagedViews: Dynamo would specialise on its ints
# (the raw size).


def whole_forward(model: LlamaForCausalLM, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
                   rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                   table: torch.Tensor, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's forward over a staged bucket, every write through ``refengine::write_kv``."""
    attention = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    features = model.features(input_ids, positions, attention, out_slots,
                              InPlaceKV(k_pool, v_pool))
    return model.logits(features), features


def _head_region(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                 rows: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                 table: torch.Tensor, max_kv: int) -> tuple[torch.Tensor, ...]:
    """Embedding, attention metadata, the first layer's projections."""
    x, rope = model.embed(input_ids, positions)
    attention = static_attention(rows, seq_lens, tree_mask, table, max_kv)
    q, k, v = model.model.layers[0].project(x, rope)
    return x, rope.cos, rope.sin, attention.kv_slots, attention.mask, q, k, v


def _middle_region(layer: DecoderLayer, following: DecoderLayer, x: torch.Tensor,
                   q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    """The rest of ``layer`` (its KV written), the projections of ``following``."""
    x = layer.finish(x, q, k_cache, v_cache, AttentionMetadata(kv_slots, mask))
    return (x, *following.project(x, RopeAt(cos, sin)))


def _tail_region(model: LlamaForCausalLM, last: DecoderLayer, x: torch.Tensor, q: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the last layer, the final norm, the LM head."""
    features = model.model.norm(last.finish(x, q, k_cache, v_cache,
                                            AttentionMetadata(kv_slots, mask)))
    return model.logits(features), features


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
    tests use it to check the compiled forward gives the model's bits.
    ``freeze_weights`` (the "frozen" executor, see ``compile.FROZEN_WEIGHTS``): faster keys
    that every process compiles again; the model's weights must not change after a key is
    compiled.
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
        return torch.compile(own_code(fn), backend=self.backend, fullgraph=True, dynamic=False)

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        self.run(key, views)

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        if self.split == "whole" and key not in self._whole:
            self._whole[key] = self._compile(whole_forward)
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
            model, views.input_ids, views.positions, views.rows, views.seq_lens,
            views.tree_mask, self.table, key.max_kv)
        last = len(layers) - 1
        for i in range(last):
            kv.write(i, views.out_slots, k, v)  # eager, between two compiled regions
            x, q, k, v = regions.middle(layers[i], layers[i + 1], x, q, cos, sin,
                                        kv.k[i], kv.v[i], kv_slots, mask)
        kv.write(last, views.out_slots, k, v)
        return regions.tail(model, layers[last], x, q, kv.k[last], kv.v[last], kv_slots, mask)
