"""``specgate bench``: check the arguments, run the lanes, print the table."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from conformance.plan.arguments import GRAPHS_AUTO, add_graphs_argument, count
from conformance.plan.device import device_arg
from conformance.plan.preflight import validate
from conformance.plan.usage import UsageError
from conformance.report.files import output_file, write_atomically

if TYPE_CHECKING:
    from conformance.contract import Backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.plan.specs import SPECS

    parser.add_argument("--backends", default=None,
                        help="comma-separated (unset: refengine,hf for --spec none; refengine "
                             "otherwise, compared with its own plain decoding; with a spec, "
                             "further backends decode plainly beside it)")
    parser.add_argument("--spec", default="none",
                        help=f"{' | '.join(SPECS)} | chains; eagle-v2 runs beside its V1 twins, "
                             "eagle3, mtp and ngram beside EAGLE at equal N; chains: plain, "
                             "EAGLE, EAGLE-3, n-gram and draft-model chains on every backend "
                             "claiming each, every (backend, lane) in a process of its own, "
                             "outputs compared")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--max-new-tokens", type=count, default=64, help="tokens per request")
    parser.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    parser.add_argument("--min-requests", type=count, default=8,
                        help="requests per batch size at least: batch b runs ceil(n/b) groups")
    parser.add_argument("--repeats", type=count, default=1,
                        help="run every group this many times per lane and keep the fastest")
    parser.add_argument("--json", default=None,
                        help="also write the figures to this file (its directory is created)")
    parser.add_argument("--draft-model", default=None,
                        help="override the spec configurations' draft model (their EAGLE "
                             "twins keep tiny-code-eagle; ngram, which has none: its twins'; "
                             "--spec chains: the EAGLE lanes' head, default "
                             "tiny-code-eagle-vllm)")
    add_graphs_argument(parser, GRAPHS_AUTO, "also run each lane of a backend claiming "
                        "graph_runner through its graph runner with this executor, in a lane "
                        "of its own: %(choices)s; auto: the device's fastest (aot on the CPU, "
                        "whose first run on a machine compiles each key for minutes in all; "
                        "cuda graphs on a GPU); none: no graph lanes")
    parser.add_argument("--device", default="cpu", type=device_arg,
                        help="where every backend runs: cpu, cuda or cuda:N; on CUDA the table "
                             "adds device time per step, capture cost and GPU memory")


def cmd_bench(args: argparse.Namespace) -> int:
    from conformance.bench.lanes import CHAINS, parse_backends, parse_batch_sizes
    from conformance.bench.measure import run_bench
    from conformance.bench.result import format_table
    from conformance.plan.device import best_graphs, device_problem
    from conformance.report.progress import Steps

    graphs = best_graphs(args.graphs, args.device)
    problem = device_problem(args.device, graphs)
    if problem:
        raise UsageError(problem)
    chains = args.spec == CHAINS
    try:
        backends = parse_backends(args.backends or ("refengine,hf" if args.spec == "none"
                                                    else "refengine"))
    except ValueError as err:
        raise UsageError(str(err)) from None
    # --spec chains: backends and model checked here, the draft models once the lanes are known
    loaded = validate("none" if chains else args.spec, backends, args.model,
                      None if chains else args.draft_model)
    if graphs and not any(b.capabilities().graph_runner for b in loaded):
        if args.graphs != GRAPHS_AUTO:  # asked for by name: say why it cannot be had
            raise UsageError(f"--graphs: none of {', '.join(backends)} claims graph_runner")
        graphs = None  # the default: graph lanes for the backends that have a graph runner
    json_path = output_file(args.json) if args.json else None
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        if chains:
            text, data = _bench_chains(args, backends, loaded, batch_sizes, graphs)
        else:
            with Steps("bench", len(batch_sizes)) as steps:
                result = run_bench(backends=backends, batch_sizes=batch_sizes,
                                   max_new_tokens=args.max_new_tokens, spec=args.spec,
                                   progress=steps, model=args.model,
                                   draft_model=args.draft_model,
                                   min_requests=args.min_requests, repeats=args.repeats,
                                   graphs=graphs, device=args.device)
            text, data = format_table(result), asdict(result)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(text)
    if json_path is not None:
        write_atomically(json_path, json.dumps(data, indent=1) + "\n")
    return 0


def _bench_chains(args: argparse.Namespace, backends: list[str], loaded: list[Backend],
                  batch_sizes: list[int], graphs: str | None) -> tuple[str, dict[str, Any]]:
    """``--spec chains``: plan the lanes from what each backend claims, check their draft
    models, run each in a process of its own (``isolated``); -> the table and the JSON data."""
    from conformance.bench.compare import format_isolated, reference_backend
    from conformance.bench.isolated import IsolatedBench, run_isolated
    from conformance.bench.lanes import SHARED_EAGLE_HEAD, Workload, chain_lanes, with_graph_lanes
    from conformance.report.progress import Steps
    from refengine.data import resolve_model_dir
    from refengine.model.loader import check_draft_dir

    caps = {name: backend.capabilities() for name, backend in zip(backends, loaded, strict=True)}
    eagle_head = args.draft_model or SHARED_EAGLE_HEAD
    lanes = chain_lanes(backends, lambda b, algorithm: algorithm in caps[b].algorithms,
                        eagle_head)
    if graphs:
        lanes = with_graph_lanes(lanes, graphs, lambda b: caps[b].graph_runner)
    for draft in sorted({ln.spec.draft_model for ln in lanes
                         if ln.spec is not None and ln.spec.needs_draft_model}):
        check_draft_dir(resolve_model_dir(draft))
    workload = Workload(args.model, tuple(batch_sizes), args.max_new_tokens,
                        args.min_requests, args.repeats, args.device)
    bench = IsolatedBench(args.model, args.max_new_tokens, args.min_requests, args.repeats,
                          batch_sizes, backends, reference_backend(backends), eagle_head)
    with Steps("bench", len(lanes)) as steps:
        run_isolated(lanes, workload, bench, steps)
    return format_isolated(bench), asdict(bench)
