"""A package's GEMM kernels against the rows it multiplies: one target key (bucket, tokens per
request, key width) built as an AOTInductor package each way ``package_settings`` chooses
between (inductor's C++ GEMM templates; ATen's GEMM on the folded weights), timed beside the
eager forward of the same key, taking turns in one process, on the ``tiny-code`` fixture.

    python benchmarks/package_gemms.py [--bucket 40] [--tokens 16] [--width 512] [--threads 1]

The key is called on a batch of padding whose rows name ``--width`` distinct KV slots, so its
attention gathers what a real batch at that width gathers. Both packages are built into a
temporary cache (20 to 40 s each). Rows = bucket x tokens; ``MANY_ROWS`` in ``aot.py`` is
where the two package columns cross on the machine it was measured on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from refengine.data import resolve_model_dir
from refengine.graph import aot
from refengine.graph.forward import whole_forward
from refengine.graph.runner import GraphRunner
from refengine.graph.target import GraphKey
from refengine.memory.manager import KVManager
from refengine.model.llama import LlamaForCausalLM
from refengine.runner import ModelRunner

# MANY_ROWS values that force each setting for any key
SETTINGS = {"templates": 1 << 30, "aten": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", type=int, default=40, help="requests in the key")
    parser.add_argument("--tokens", type=int, default=16,
                        help="tokens per request (1: a decode key, more: a verify key)")
    parser.add_argument("--width", type=int, default=512, help="the key's width (KV columns)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--calls", type=int, default=7, help="timed calls per way")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = LlamaForCausalLM.load(resolve_model_dir("tiny-code"), torch.float32, "cpu")
    cfg = model.config
    kv = KVManager(args.width * 2, 1, args.bucket, cfg.max_position_embeddings,
                   (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                   torch.float32, "cpu", row_headroom=args.tokens)
    runner = ModelRunner(model, None, kv)
    graph = GraphRunner(runner, "replay", verify_tokens=args.tokens if args.tokens > 1 else None,
                        sizes=[args.bucket], kv_sizes=[args.width])
    kind = "verify" if args.tokens > 1 else "decode"
    key = GraphKey(kind, args.bucket, args.width)
    views = graph.staging[kind].stage(None, args.bucket)
    table = kv.rows.table
    table[:, :args.width] = torch.arange(args.width) + 1  # distinct slots past the dummy one
    inputs = [kv.target_pool.k, kv.target_pool.v, views.input_ids, views.positions,
              views.out_slots, views.rows, views.seq_lens, views.tree_mask, table]

    calls: dict[str, Callable[[], object]] = {
        "eager": lambda: whole_forward(model, *inputs, args.width)}
    with tempfile.TemporaryDirectory(prefix="specgate-gemms-") as cache_root:
        cache = aot.PackageCache(Path(cache_root), progress=None)
        for name, many_rows in SETTINGS.items():
            aot.MANY_ROWS = many_rows
            executor = aot.AotExecutor(graph.program, cache)
            start = time.perf_counter()
            executor.prepare(key, views)
            print(f"{name}: built in {time.perf_counter() - start:.0f} s", flush=True)
            calls[name] = lambda executor=executor: executor.run(key, views)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        with torch.inference_mode():
            for i in range(args.calls + 1):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if i:  # the first round warms allocators
                        samples[name].append((time.perf_counter() - start) * 1e3)
    rows = args.bucket * args.tokens
    print(f"{kind} key, bucket {args.bucket}, {args.tokens} token(s) per request ({rows} rows), "
          f"width {args.width}, {args.threads} thread(s); median ms per call of "
          f"{args.calls}:")
    for name, s in samples.items():
        print(f"  {name:10s} {statistics.median(s):8.1f}")


if __name__ == "__main__":
    main()
