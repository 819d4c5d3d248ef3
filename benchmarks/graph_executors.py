"""Per-step time of the target's decode and verify forwards, eager vs the graph runner's
executors (replay; compiled as one region with the KV write as a custom op; compiled as
per-layer regions with eager writes), side by side in one process on the ``tiny-code``
fixture; and compile time per key, cold (empty inductor cache) and warm (a new process on the
cache the cold compiles filled).

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
from pathlib import Path

import torch

from refengine.config import SamplingParams
from refengine.data import resolve_model_dir
from refengine.graph import GraphRunner, StagedViews, StepInputs
from refengine.graph.runner import GraphBatch
from refengine.memory.kv_pool import KVPool
from refengine.memory.manager import KVManager
from refengine.model.llama import ForwardBatch, ForwardOutput, LlamaForCausalLM
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


EXECUTORS = ("replay", "compiled", "compiled-layers")
COMPILED = ("compiled", "compiled-layers")


def graphs(runner: ModelRunner, kv_width: int) -> dict[str, GraphRunner]:
    kv_sizes = [kv_width] if kv_width else None
    return {name: GraphRunner(runner, name, max_bs=MAX_BS, verify_tokens=VERIFY_N,
                              kv_sizes=kv_sizes) for name in EXECUTORS}


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
    from refengine.graph.staging import static_attention

    def naive(model: LlamaForCausalLM, pool: KVPool, views: StagedViews, table: torch.Tensor,
              max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        attention = static_attention(views.rows, views.seq_lens, views.tree_mask, table, max_kv)
        features = model.features(views.input_ids, views.positions, attention,
                                  views.out_slots, pool)  # the pool's own indexed writes
        return model.logits(features), features

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
