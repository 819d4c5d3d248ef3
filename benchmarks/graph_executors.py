"""Per-step time of the target's decode and verify forwards, eager vs the graph runner's
executors (replay; compiled as one region with the KV write as a custom op; compiled as
per-layer regions with eager writes), side by side in one process on the ``tiny-code``
fixture; and compile time per key, cold (empty inductor cache) and warm (a new process on the
cache the cold compiles filled). The per-layer variant (``LayersExecutor``) lives here only:
one compiled call per layer costs a fixed overhead on CPU (guards, wrappers) that eats most of
what fusing saves, so the engine keeps the one-region "compiled" executor.

    python benchmarks/graph_executors.py [--threads 1] [--context 128] [--kv-width W]
                                         [--iters 20] [--profile] [--trap]

Requests are prefilled eagerly to ``--context`` tokens; each timed step is one ``forward`` of
a prepared batch (batch building and KV allocation are not timed: both paths share them), and
the executors take turns step by step so machine noise hits them alike. ``--kv-width`` is the
graph keys' key width (default: just past the longest request; 0: the runner's default
ladder); eager always gathers exactly the longest request. ``--profile`` prints
where batch-1 decode steps spend their time; ``--trap`` times the naive alternative (the pool
write traced inside one compiled forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refengine.config import SamplingParams
from refengine.data import resolve_model_dir
from refengine.graph.compile import WarmKeys, own_code
from refengine.graph.compiled import CompiledExecutor
from refengine.graph.program import K2, R2, V2, Executor, Program
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import StagedViews, StepInputs, static_attention
from refengine.graph.target import GraphKey
from refengine.memory.kv_pool import KVPool
from refengine.memory.manager import KVManager
from refengine.model.attention import AttentionMetadata
from refengine.model.llama import (
    DecoderLayer,
    ForwardBatch,
    ForwardOutput,
    LlamaForCausalLM,
    RopeAt,
)
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.inputs import VerifyInput

MAX_BS = 32
VERIFY_N = 4
SHAPES = [("decode", 1), ("decode", 8), ("decode", 32), ("verify", 1), ("verify", 8)]


def build(context: int) -> tuple[ModelRunner, list[Req]]:
    model = LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "cpu")
    cfg = model.config
    kv = KVManager(16384, 1, MAX_BS, cfg.max_position_embeddings,
                   (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                   torch.float32, "cpu", row_headroom=VERIFY_N)
    runner = ModelRunner(model, None, kv)
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(MAX_BS):
        ids = torch.randint(1, cfg.vocab_size, (context,), generator=gen).tolist()
        req = Req(f"r{i}", ids, SamplingParams(), 0, i)
        assert kv.assign_row(req)
        kv.extend(req, context)
        runner.forward(runner.prepare_extend([req], [context], ids, [context - 1]))
        kv.commit(req, context)
        reqs.append(req)
    return runner, reqs


def make_batch(graph: GraphRunner, kind: str, reqs: list[Req]) -> ForwardBatch:
    b = len(reqs)
    if kind == "decode":
        for r in reqs:
            graph.kv.extend(r, 1)
        return graph.prepare_extend(reqs, [1] * b, [7] * b, list(range(b)))
    start = torch.tensor([r.kv_committed_len for r in reqs])
    minus = torch.full((b, VERIFY_N), -1, dtype=torch.int64)
    verify_input = VerifyInput(torch.full((b, VERIFY_N), 7, dtype=torch.int64),
                               torch.ones(b, VERIFY_N, VERIFY_N, dtype=torch.bool).tril(),
                               start[:, None] + torch.arange(VERIFY_N), minus, minus, minus,
                               minus)
    slots = torch.stack([graph.kv.extend(r, VERIFY_N) for r in reqs])
    return graph.prepare_verify(reqs, verify_input, slots, causal=True)


# --- "compiled-layers": the target's forward as per-layer regions, eager KV writes between ---


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


class LayersExecutor:
    """The target's decode and verify keys compiled as regions between the KV writes
    ("attention and MLP of layer l-1, then norm, projections and RoPE of layer l"), the writes
    eager between them: no custom op, one compiled call per layer. It composes the model's own
    pieces (``embed``/``logits``, ``DecoderLayer.project``/``finish``);
    ``tests/test_graph_runner.py`` checks, with the "eager" backend, that it gives the replay's
    bits. A draft loop beside it runs on the engine's "compiled" executor."""

    name = "compiled-layers"
    outputs_persist = False  # inductor allocates outputs per call

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, table: torch.Tensor,
                 backend: str = "inductor") -> None:
        self.model, self.kv, self.table, self.backend = model, kv, table, backend
        self._regions: dict[GraphKey, _Regions] = {}
        self._warm = WarmKeys(freeze_weights=False)

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(own_code(fn), backend=self.backend, fullgraph=True, dynamic=False)

    def prepare(self, key: GraphKey, views: StagedViews) -> None:
        self.run(key, views)

    def run(self, key: GraphKey, views: StagedViews) -> ForwardOutput:
        if key not in self._regions:
            self._regions[key] = _Regions(self._compile(_head_region),
                                          self._compile(_middle_region),
                                          self._compile(_tail_region))
        with self._warm.settings(key), torch.inference_mode():
            return ForwardOutput(*self._run_layers(self._regions[key], key, views))

    def pending(self) -> list[GraphKey]:
        return []

    def sibling(self, program: Program[K2, V2, R2]) -> Executor[K2, V2, R2]:
        return CompiledExecutor(program, self.backend)

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


EXECUTORS = ("replay", "compiled", "compiled-layers")
COMPILED = ("compiled", "compiled-layers")


def graphs(runner: ModelRunner, kv_width: int) -> dict[str, GraphRunner]:
    kv_sizes = [kv_width] if kv_width else None
    layers = LayersExecutor(runner.target, runner.kv.target_pool, runner.kv.rows.table)
    return {name: GraphRunner(runner, layers if name == "compiled-layers" else name,
                              max_bs=MAX_BS, verify_tokens=VERIFY_N, kv_sizes=kv_sizes)
            for name in EXECUTORS}


def compile_times(by_name: dict[str, GraphRunner]) -> dict[str, dict[str, float]]:
    """Seconds to compile (and run once) each key the shapes use, per compiled executor."""
    out: dict[str, dict[str, float]] = {}
    for name in COMPILED:
        out[name] = {}
        for kind, b in SHAPES:
            seconds = by_name[name].capture(kinds=[kind], sizes=[b])
            out[name][f"{kind} b={b}"] = sum(seconds.values())
    return out


def time_steps(runner: ModelRunner, graph_by_name: dict[str, GraphRunner], reqs: list[Req],
               kind: str, b: int, iters: int) -> dict[str, float]:
    """Median ms per forward for eager and each executor, taking turns every step."""
    batch_reqs = reqs[:b]
    forwards: dict[str, Callable[[ForwardBatch], ForwardOutput]] = {"eager": runner.forward}
    forwards.update({name: g.forward for name, g in graph_by_name.items()})
    graph = graph_by_name["replay"]
    samples: dict[str, list[float]] = {name: [] for name in forwards}
    for i in range(iters + 2):
        for name, forward in forwards.items():
            batch = make_batch(graph, kind, batch_reqs)  # tagged: every path can run it
            assert name == "eager" or graph.can_run(batch)
            start = time.perf_counter()
            forward(batch)
            elapsed = time.perf_counter() - start
            for r in batch_reqs:
                runner.kv.truncate(r, r.kv_committed_len)
            if i >= 2:  # the first two rounds warm caches and allocators
                samples[name].append(elapsed * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def profile_steps(runner: ModelRunner, forward: Callable[[ForwardBatch], ForwardOutput],
                  graph: GraphRunner, reqs: list[Req], title: str, steps: int = 10) -> None:
    """Top ops by self CPU time over ``steps`` batch-1 decode steps, by input shape (a
    pool-sized copy would show the pool's shape; work inside generated kernels shows as the
    compiled graph's own self time)."""
    from torch.profiler import ProfilerActivity, profile

    batch_reqs = reqs[:1]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            batch = make_batch(graph, "decode", batch_reqs)
            forward(batch)
            runner.kv.truncate(batch_reqs[0], batch_reqs[0].kv_committed_len)
    print(f"\n{title}, {steps} steps, top ops by self CPU time:")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=55,
        max_shapes_column_width=50))


def trap(runner: ModelRunner, graph: GraphRunner, reqs: list[Req], kv_width: int) -> None:
    """The naive compiled forward: the pool write (``KVPool.write``'s indexing) traced inside
    the compiled region, where functionalization makes it a copy of the whole pool."""
    def naive(model: LlamaForCausalLM, pool: KVPool, views: StagedViews, table: torch.Tensor,
              max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        attention = static_attention(views.rows, views.seq_lens, views.tree_mask, table, max_kv)
        normed, drafted = model.features(views.input_ids, views.positions, attention,
                                         views.out_slots, pool)  # the pool's own indexed writes
        return model.logits(normed), drafted

    compiled = torch.compile(naive, fullgraph=True, dynamic=False)
    width = kv_width or runner.kv.rows.table.shape[1]
    kv = runner.kv.target_pool

    def forward(batch: ForwardBatch) -> ForwardOutput:
        assert isinstance(batch, GraphBatch) and batch.rows is not None
        assert batch.seq_lens is not None
        views = graph.staging["decode"].stage(StepInputs(
            batch.input_ids, batch.positions, batch.out_slots, batch.rows, batch.seq_lens), 1)
        with torch.inference_mode():
            logits, features = compiled(runner.target, kv, views, runner.kv.rows.table, width)
        return ForwardOutput(logits, features)

    start = time.perf_counter()
    batch = make_batch(graph, "decode", reqs[:1])
    forward(batch)
    runner.kv.truncate(reqs[0], reqs[0].kv_committed_len)
    print(f"\ntrap: pool write inside the compiled forward, compiled in "
          f"{time.perf_counter() - start:.1f} s")
    profile_steps(runner, forward, graph, reqs, "trap, decode b=1", steps=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--kv-width", type=int, default=None,
                        help="graph key width (default: the longest request rounded up to a "
                        "multiple of 64; 0: the runner's default ladder)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trap", action="store_true")
    parser.add_argument("--cache-dir", help="inductor cache (default: a fresh one, so the "
                        "first compiles are cold)")
    parser.add_argument("--compile-only", action="store_true",
                        help="(internal) compile the keys, print their times as JSON")
    args = parser.parse_args()
    if args.cache_dir:
        run(args, args.cache_dir)
        return
    with tempfile.TemporaryDirectory(prefix="specgate-inductor-") as cache:
        run(args, cache)  # a fresh cache, so the first compiles are cold; removed afterwards


def run(args: argparse.Namespace, cache: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch.set_num_threads(args.threads)
    if args.kv_width is None:
        args.kv_width = -(-(args.context + VERIFY_N) // 64) * 64
    runner, reqs = build(args.context)
    by_name = graphs(runner, args.kv_width)
    if args.compile_only:
        print(json.dumps(compile_times(by_name)))
        return

    print(f"tiny-code float32, {torch.get_num_threads()} thread(s), context {args.context}, "
          f"graph key width {args.kv_width or 'row table'}, inductor cache {cache}")
    cold = compile_times(by_name)
    by_name["replay"].capture()
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile-only",
                            "--cache-dir", cache, "--threads", str(args.threads),
                            "--context", str(args.context), "--kv-width", str(args.kv_width)],
                           capture_output=True, text=True, check=True)
    warm = json.loads(child.stdout.strip().splitlines()[-1])

    columns = ("eager", *EXECUTORS)
    header = (f"{'step':<16}" + "".join(f"{name + ' ms':>20}" for name in columns)
              + f"{'eager/compiled':>16}")
    print("\n" + header + "\n" + "-" * len(header))
    for kind, b in SHAPES:
        ms = time_steps(runner, by_name, reqs, kind, b, args.iters)
        label = f"{kind} b={b}" + (f" N={VERIFY_N}" if kind == "verify" else "")
        print(f"{label:<16}" + "".join(f"{ms[name]:>20.2f}" for name in columns)
              + f"{ms['eager'] / ms['compiled']:>15.2f}x")

    header = (f"{'compile (s)':<16}{'key':<26}"
              + "".join(f"{name + ' cold':>22}{'warm':>8}" for name in COMPILED))
    print("\n" + header + "\n" + "-" * len(header))
    for kind, b in SHAPES:
        name = f"{kind} b={b}"
        key = by_name["replay"].graph_key(make_batch(by_name["replay"], kind, reqs[:b]))
        for r in reqs[:b]:
            runner.kv.truncate(r, r.kv_committed_len)
        shown = f"{key.kind} bucket={key.bucket} kv={key.max_kv}" if key is not None else "-"
        print(f"{name:<16}{shown:<26}" + "".join(
            f"{cold[ex][name]:>22.1f}{warm[ex][name]:>8.1f}" for ex in COMPILED))
    print("(warm: a new process on the cache the cold compiles filled; Dynamo still traces)")

    if args.profile:
        profile_steps(runner, by_name["compiled"].forward, by_name["replay"], reqs,
                      "compiled (one region, write op), decode b=1")
        profile_steps(runner, by_name["compiled-layers"].forward, by_name["replay"], reqs,
                      "compiled-layers, decode b=1")
        profile_steps(runner, runner.forward, by_name["replay"], reqs, "eager, decode b=1")
    if args.trap:
        trap(runner, by_name["replay"], reqs, args.kv_width)


if __name__ == "__main__":
    main()
