"""The draft loop as one graph: a whole draft step (every forward, the top-k and the beam
bookkeeping) replayed on static, bucket-padded buffers.

Two loops, one per draft kind, and EAGLE's draft-extend:

* ``draft:eagle``: the ``S - 1`` forwards of the EAGLE head from the step's ``DraftInput``;
  each writes the head's KV into the step's scratch slots (staged, one row per request) and
  sees the committed prefix and its ancestors' scratch entries.
* ``draft:mtp``: Frozen-KV MTP with the seed folded in as iteration 0. The graph takes the
  per-request ``bonus_tokens`` and target features as staged buffers and produces the first
  candidates (``topk_p``/``topk_index``) itself, then runs the ``S - 1`` later iterations.
  Every buffer, ``bonus_tokens`` included, is restaged on every replay: a buffer left as it
  was captured would replay an earlier step's tokens (outputs stay lossless, acceptance
  silently drops).
* ``extend:eagle``: the EAGLE head over each request's accepted tokens after verify (the
  draft-extend), right-aligned in ``N`` columns; it writes the head's KV for every row and
  predicts from the last one.

The loops end with ``search`` (``refengine/speculative/draft_search.py``: the chain or the
beam), the same search the eager draft runs, so only the forwards differ: here their attention
metadata is derived inside the graph from the staged rows and lengths
(``AttentionMetadata.over_blocks``) at a fixed key width. Tree assembly stays eager, in the
worker.

Padding: every padded row reads and writes only the reserved dummy row/slot and computes
finite values (``LOOP_FIELDS`` says why for each buffer).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refengine.device import from_host
from refengine.graph.aot import AotPackages, PackageCache, open_limits, register_tables
from refengine.graph.compile import InPlaceKV, WarmKeys, own_code
from refengine.graph.cuda_graph import CudaGraphs, GraphRecorder, KeyedGraphs, clone_outputs
from refengine.graph.staging import DUMMY_ROW, DUMMY_SLOT, pad_to_bucket
from refengine.memory.kv_pool import KVPool
from refengine.model.attention import AttentionMetadata
from refengine.model.eagle import EagleDraftModel
from refengine.model.frozen_kv_mtp import FrozenKVMTPDraftModel
from refengine.speculative.draft_search import Candidates, LoopOutput, search, top_k
from refengine.speculative.inputs import DraftExtendInput


@dataclass(frozen=True)
class LoopField:
    """One staged buffer of a draft loop: per-request shape and dtype, and what a padded
    request's entry holds (and why that is harmless)."""

    tail: tuple[str, ...]      # per-request shape, by name: "k", "H", "scratch"
    dtype: str                 # "int64", "float32", "hidden" (the model's dtype)
    fill: float
    why: str


_TOKEN = LoopField((), "int64", 0, "token 0 is in every vocabulary: the embedding gather stays "
                   "in bounds; the row's outputs are sliced away")
_HIDDEN = LoopField(("H",), "hidden", 0.0, "finite, so nothing a padded row computes is NaN "
                    "(a NaN written to the dummy page would be read back by every padded row)")
_DUMMY_PAGE = ("the padded rows' draft KV lands in the reserved page, which no request "
               "owns")
_ROWS = LoopField((), "int64", DUMMY_ROW, "the reserved row is never written, so every key "
                  "slot gathered through it is the dummy slot; a stale real row here would read "
                  "another request's KV")

LOOP_FIELDS: dict[str, dict[str, LoopField]] = {
    "draft:eagle": {
        "topk_p": LoopField(("k",), "float32", 1.0, "finite path scores"),
        "topk_index": LoopField(("k",), "int64", 0, _TOKEN.why),
        "hidden": _HIDDEN,
        "rows": _ROWS,
        "roots": LoopField((), "int64", 0, "no prefix: the scratch block starts at column 0 of "
                           "the dummy row, whose every slot is the dummy slot"),
        "scratch": LoopField(("scratch",), "int64", DUMMY_SLOT, _DUMMY_PAGE),
    },
    "extend:eagle": {
        "ids": LoopField(("N",), "int64", 0, _TOKEN.why),
        "hidden": LoopField(("N", "H"), "hidden", 0.0, _HIDDEN.why),
        "rows": _ROWS,
        "ends": LoopField((), "int64", 1, "the kept query sits at position 0 and sees column 0 "
                          "of the dummy row only"),
        "slots": LoopField(("N",), "int64", DUMMY_SLOT, _DUMMY_PAGE),
    },
    "draft:mtp": {
        "bonus_tokens": _TOKEN,
        "hidden": _HIDDEN,
        "rows": _ROWS,
        "seq_lens": LoopField((), "int64", 1, "a one-position prefix: the query sits at "
                              "position 0 and sees column 0 of the dummy row only"),
    },
}


class LoopStaging:
    """Max-size static buffers for one draft loop, one leading row per request, allocated once;
    a bucket's view is a contiguous prefix (stable addresses across replays)."""

    def __init__(self, kind: str, max_bs: int, sizes: dict[str, int], hidden_dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.kind, self.max_bs = kind, max_bs
        self.fields = LOOP_FIELDS[kind]
        dtypes = {"int64": torch.int64, "float32": torch.float32, "hidden": hidden_dtype}
        self.buffers = {name: torch.full((max_bs, *(sizes[d] for d in f.tail)), f.fill,
                                         dtype=dtypes[f.dtype], device=device)
                        for name, f in self.fields.items()}

    def stage(self, inputs: dict[str, torch.Tensor] | None, bucket: int
              ) -> dict[str, torch.Tensor]:
        """Copy ``inputs`` (every field, ``raw`` rows) into rows ``[:raw]`` and the fill into
        ``[raw:bucket]``, every buffer on every replay; ``None`` stages padding only."""
        raw = 0 if inputs is None else next(iter(inputs.values())).shape[0]
        if not 0 <= raw <= bucket <= self.max_bs:
            raise ValueError(f"staging {raw} requests into bucket {bucket} "
                             f"(buffers hold {self.max_bs})")
        if inputs is not None and set(inputs) != set(self.fields):
            raise ValueError(f"{self.kind}: inputs {sorted(inputs)}, expected "
                             f"{sorted(self.fields)}")
        for name, buf in self.buffers.items():
            self.restage(name, buf, None if inputs is None else inputs[name], raw, bucket)
        return {name: buf[:bucket] for name, buf in self.buffers.items()}

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        """One buffer's real rows and padding (an extension point: the bug zoo skips one)."""
        if value is not None:
            buf[:raw].copy_(value)
        buf[raw:bucket] = self.fields[name].fill


# --- the loops: the captured callables --------------------------------------------------------
# The pool a loop reads and writes: the engine's, or (an exported loop) its tensors as inputs.
LoopPool = KVPool | InPlaceKV


def eagle_forward(draft: EagleDraftModel, pool: LoopPool, tokens: torch.Tensor,
                  features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  attention: AttentionMetadata, keep: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``EagleDraftModel.forward`` on a graph's tensors, its KV written through
    ``refengine::write_kv``: every row writes into ``slots``; the ``keep`` rows (all if None),
    whose queries ``attention`` covers, are predicted from."""
    x = draft.fuse(tokens, features)
    x = draft.layer(x, draft.rotary.at(positions, x.dtype), attention, slots,
                    InPlaceKV(pool.k, pool.v), keep)
    return draft.predict(x)


def eagle_loop(draft: EagleDraftModel, pool: LoopPool, table: torch.Tensor, topk: int,
               steps: int, max_kv: int, topk_p: torch.Tensor, topk_index: torch.Tensor,
               hidden: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor,
               scratch: torch.Tensor) -> LoopOutput:
    b, k = rows.shape[0], topk

    def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        block = (torch.ones((b, 1, i), dtype=torch.bool, device=rows.device)
                 if node_mask is None else node_mask[:, :, :i * k])
        attention = AttentionMetadata.over_blocks(table, rows, roots, max_kv, block)
        positions = (roots + (i - 1))[:, None].expand(b, k).reshape(-1)
        return eagle_forward(draft, pool, tokens, features, positions,
                             scratch[:, (i - 1) * k:i * k].reshape(-1), attention)

    return search(topk_p, topk_index, hidden, steps, forward)


def eagle_extend(draft: EagleDraftModel, pool: LoopPool, table: torch.Tensor, topk: int,
                 steps: int, max_kv: int, ids: torch.Tensor, hidden: torch.Tensor,
                 rows: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's draft-extend (``EagleDrafter.extend``) on ``N`` rows per request: its
    accepted tokens right-aligned, ending before ``ends`` (the root), after front padding
    (token 0, zero features, the dummy slot). Every row writes the head's KV; only each
    request's last row, its newest accepted token, goes on through attention, MLP, norm and
    LM head, as the eager forward's ``keep`` does. -> (logits, predicted features), a row per
    request."""
    b, n = ids.shape
    columns = torch.arange(n, device=ids.device)
    positions = (ends[:, None] - n + columns).clamp(min=0).reshape(-1)
    last = torch.arange(b, device=ids.device) * n + (n - 1)
    attention = AttentionMetadata.over_blocks(table, rows, ends - 1, max_kv)  # the last rows
    return eagle_forward(draft, pool, ids.reshape(-1), hidden.reshape(b * n, -1), positions,
                         slots.reshape(-1), attention, keep=last)


def mtp_forward(draft: FrozenKVMTPDraftModel, tokens: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, attention: AttentionMetadata, pool: LoopPool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The assistant's own forward (its class's, a subclass's included) without the
    ``inference_mode`` decorator where it has one: the executor already runs in inference mode,
    and inductor cannot compile the decorator's mode switch (it fails on the pool's inference
    tensors)."""
    forward = type(draft).forward
    forward = getattr(forward, "__wrapped__", forward)
    return forward(draft, tokens, hidden, positions, attention, pool)


def mtp_loop(draft: FrozenKVMTPDraftModel, pool: LoopPool, table: torch.Tensor, topk: int,
             steps: int, max_kv: int, bonus_tokens: torch.Tensor, hidden: torch.Tensor,
             rows: torch.Tensor, seq_lens: torch.Tensor) -> LoopOutput:
    """The seed (iteration 0) over one row per request, then ``steps - 1`` iterations over
    ``topk`` rows per request; every query sits at ``seq_len - 1`` and sees ``[0, seq_len)``,
    so one metadata serves them all."""
    k = topk
    expanded = AttentionMetadata.over_blocks(table, rows.repeat_interleave(k),
                                             (seq_lens - 1).repeat_interleave(k), max_kv)
    positions = (seq_lens - 1).clamp(min=0).repeat_interleave(k)
    seed = AttentionMetadata(expanded.kv_slots[::k], expanded.mask[::k])
    logits, seed_hidden = mtp_forward(draft, bonus_tokens, hidden, positions[::k], seed, pool)
    topk_p, topk_index = top_k(logits, k)

    def forward(i: int, tokens: torch.Tensor, features: torch.Tensor,
                node_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return mtp_forward(draft, tokens, features, positions, expanded, pool)

    return search(topk_p, topk_index, seed_hidden, steps, forward)


GraphOutput = LoopOutput | tuple[torch.Tensor, torch.Tensor]  # a loop's, or extend's
LOOP_EXECUTORS = ("replay", "compiled", "frozen", "cuda", "aot")
LOOPS: dict[str, Callable[..., GraphOutput]] = {
    "draft:eagle": eagle_loop, "draft:mtp": mtp_loop, "extend:eagle": eagle_extend}


def _slice(out: GraphOutput, raw: int) -> GraphOutput:
    if isinstance(out, Candidates):
        return Candidates(out.scores[:raw], out.tokens[:raw], out.parents[:raw])
    if isinstance(out, tuple):
        return (out[0][:raw], out[1][:raw])
    return out[:raw]


class DraftLoopGraph:
    """``run(inputs)``: stage -> execute -> slice a whole draft step, for batches of up to the
    largest bucket whose longest request fits the widest key width; None otherwise (the worker
    then drafts eagerly).

    Executors: "replay" calls the loop on the static views; "compiled" compiles it per key
    (``fullgraph``, static shapes; one code copy per key, as ``CompiledExecutor``); "frozen"
    compiles it with the draft's weights folded in (``FROZEN_WEIGHTS``); "cuda" captures it per
    key as a CUDA graph (``cuda_graph.py``) and copies each replay's outputs out; "aot" calls
    a persistent package per key, compiled once per machine with the draft's weights folded
    in (``aot.py``, whose ``package_settings`` pick the GEMM kernels by the key's rows)."""

    staging_class: type[LoopStaging] = LoopStaging  # the bug zoo swaps in a broken restaging

    def __init__(self, draft: EagleDraftModel | FrozenKVMTPDraftModel, pool: KVPool,
                 table: torch.Tensor, topk: int, steps: int, sizes: Sequence[int],
                 kv_sizes: Sequence[int], executor: str, extend_rows: int = 0,
                 recorder: GraphRecorder | None = None,
                 packages: PackageCache | None = None) -> None:
        """``extend_rows`` > 0 (an EAGLE head): the graph of the head's draft-extend over that
        many rows per request ("extend:eagle") instead of the draft loop. ``recorder``: what
        records the "cuda" executor's graphs (the target's, so they share its pool; by default
        real CUDA graphs on the table's device). ``packages``: where the "aot" executor keeps
        its packages (the target's cache, so one engine reports its builds together)."""
        if executor not in LOOP_EXECUTORS:
            raise ValueError(f"draft loop executor: one of {', '.join(LOOP_EXECUTORS)}, "
                             f"got {executor!r}")
        self.draft, self.pool, self.table = draft, pool, table
        self.topk, self.steps = topk, steps
        # What one forward of the step multiplies per request: a draft step's top-k beams, or
        # the extend's rows.
        self.rows_per_request = extend_rows or topk
        self.sizes, self.kv_sizes = list(sizes), list(kv_sizes)
        self.executor = executor
        eagle = isinstance(draft, EagleDraftModel)
        if extend_rows and not eagle:
            raise ValueError("an extend graph needs an EAGLE head")
        self.kind = ("extend:eagle" if extend_rows else "draft:eagle") if eagle else "draft:mtp"
        self._loop = LOOPS[self.kind]
        hidden = draft.config.hidden_size if eagle else draft.config.target_hidden_size
        dims = {"k": topk, "H": hidden, "scratch": topk * (steps - 1), "N": extend_rows}
        dtype = draft.fc.weight.dtype if eagle else draft.pre_projection.weight.dtype
        self.staging = self.staging_class(self.kind, self.sizes[-1], dims, dtype, table.device)
        self._compiled: dict[tuple[int, int], Callable[..., Any]] = {}
        self.graphs = (KeyedGraphs(recorder or CudaGraphs(table.device))
                       if executor == "cuda" else None)
        self.packages = (AotPackages(_LoopForward(self, 0), packages) if executor == "aot"
                         else None)
        self._warm = WarmKeys(self.executor == "frozen")

    def key(self, raw: int, longest: int) -> tuple[int, int] | None:
        """(bucket, key width) for ``raw`` requests whose longest committed length (EAGLE's
        roots, MTP's sequence lengths; read on the host, so choosing a key never waits for the
        device) is ``longest``, or None: no request, too many, or one too long for the widest
        key (EAGLE's scratch lies past its root)."""
        if raw == 0 or raw > self.sizes[-1]:
            return None
        longest += self.topk * (self.steps - 1) if self.kind == "draft:eagle" else 0
        if longest > self.kv_sizes[-1]:
            return None
        return (pad_to_bucket(raw, self.sizes),
                self.kv_sizes[bisect.bisect_left(self.kv_sizes, longest)])

    def run(self, inputs: dict[str, torch.Tensor], longest: int) -> GraphOutput | None:
        """The step of ``inputs`` (every field of ``LOOP_FIELDS[kind]``); ``longest``: the
        largest of its lengths field, from the host."""
        raw = int(inputs["rows"].shape[0])
        key = self.key(raw, longest)
        if key is None:
            return None
        bucket, max_kv = key
        with torch.profiler.record_function(
                f"graph[{self.kind} raw={raw} bucket={bucket} kv={max_kv} {self.executor}]"):
            return _slice(self.execute(key, self.staging.stage(inputs, bucket)), raw)

    def extend(self, rows: torch.Tensor, ends: list[int], accepted: DraftExtendInput
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An "extend:eagle" graph run from the eager draft-extend's inputs: request i's
        accepted tokens and features (flat, in request order) end before ``ends[i]``; they are
        right-aligned in ``N`` columns, the front padded (token 0, zero features, the dummy
        slot). None when the graph does not take the batch."""
        assert self.kind == "extend:eagle"
        b, n = rows.shape[0], self.staging.buffers["ids"].shape[1]
        if b == 0 or max(accepted.host_lens()) > n:
            return None
        ids, hidden, accept_lens = accepted.input_ids, accepted.hidden_states, accepted.accept_lens
        # Request i's tokens fill its last a_i columns, in flat (row-major) order; column c
        # sits at position ends_i - n + c, as in ``eagle_extend``.
        columns = torch.arange(n, device=rows.device)
        real = columns >= (n - accept_lens)[:, None]
        padded_ids = ids.new_zeros((b, n)).masked_scatter_(real, ids)
        padded_hidden = hidden.new_zeros((b, n, hidden.shape[-1])).masked_scatter_(
            real[..., None], hidden)
        ends_on_device = from_host(ends, rows.device)
        positions = (ends_on_device[:, None] - n + columns).clamp_(min=0)
        slots = self.table[rows[:, None], positions].masked_fill_(~real, DUMMY_SLOT)
        found = self.run({"ids": padded_ids, "hidden": padded_hidden, "rows": rows,
                          "ends": ends_on_device, "slots": slots}, max(ends))
        assert found is None or isinstance(found, tuple)
        return found

    def capture_pending(self) -> None:
        """Capture the "cuda" keys first needed off the recorder's thread, each on a batch of
        padding (which writes only the dummy page)."""
        if self.graphs is None or not self.graphs.recorder.may_capture():
            return
        for key in sorted(self.graphs.pending):
            self.execute(key, self.staging.stage(None, key[0]))

    def execute(self, key: tuple[int, int], views: dict[str, torch.Tensor]) -> GraphOutput:
        args = (self.draft, self.pool, self.table, self.topk, self.steps, key[1])
        with torch.inference_mode():
            if self.executor == "replay":
                return self._loop(*args, **views)
            if self.graphs is not None:  # "cuda": replay the key's graph, copy its outputs out
                return clone_outputs(self.graphs.run(key, lambda: self._loop(*args, **views)))
            if self.packages is not None:  # "aot": the key's package, built once per machine
                return self._run_package(key, views)
            if key not in self._compiled:
                self._compiled[key] = torch.compile(own_code(self._loop), fullgraph=True,
                                                    dynamic=False)
            with self._warm.settings(key):
                return self._compiled[key](*args, **views)

    def _run_package(self, key: tuple[int, int], views: dict[str, torch.Tensor]
                     ) -> GraphOutput:
        assert self.packages is not None
        inputs = [self.pool.k, self.pool.v, self.table, *(views[f] for f in self.staging.fields)]
        if key not in self.packages:
            shape = (f"k{self.topk}-s{self.steps}"
                     + (f"-n{self.staging.buffers['ids'].shape[1]}"
                        if self.kind == "extend:eagle" else ""))
            pool, table = open_limits()
            self.packages.load(key, f"{self.kind.replace(':', '-')}-{shape}-b{key[0]}-kv{key[1]}",
                               lambda: _LoopForward(self, key[1]), inputs,
                               key[0] * self.rows_per_request, [pool, pool, table])
        return _unflatten(self.packages.run(key, inputs))


def _flatten(out: GraphOutput) -> tuple[torch.Tensor, ...]:
    if isinstance(out, Candidates):
        return (out.scores, out.tokens, out.parents)
    return out if isinstance(out, tuple) else (out,)


def _unflatten(tensors: Sequence[torch.Tensor]) -> GraphOutput:
    """``_flatten``'s inverse: a chain's tokens (one tensor), extend's pair, a beam's three."""
    if len(tensors) == 1:
        return tensors[0]
    if len(tensors) == 2:
        return (tensors[0], tensors[1])
    return Candidates(*tensors)


class _LoopForward(torch.nn.Module):
    """A draft loop at one key width as a module to export for the "aot" executor: the draft's
    weights (and the target's embedding, LM head and rotary tables it borrows, registered here
    so the package's weights digest covers them) are its own; the pool, the row table and the
    staged buffers (in ``LOOP_FIELDS`` order) are its inputs; its outputs are flat tensors."""

    def __init__(self, graph: DraftLoopGraph, max_kv: int) -> None:
        super().__init__()
        self.draft = graph.draft
        for name in ("target_embed", "target_lm_head"):
            if hasattr(graph.draft, name):
                self.add_module(f"borrowed_{name}", getattr(graph.draft, name))
        register_tables(self, graph.draft.rotary)
        self.loop, self.fields = graph._loop, list(graph.staging.fields)
        self.topk, self.steps, self.max_kv = graph.topk, graph.steps, max_kv

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``inputs``: the pool's K and V, the row table, the staged buffers."""
        k_pool, v_pool, table, *views = inputs
        return _flatten(self.loop(self.draft, InPlaceKV(k_pool, v_pool), table, self.topk,
                                  self.steps, self.max_kv, **dict(zip(self.fields, views,
                                                                      strict=True))))
