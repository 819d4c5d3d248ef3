"""``specgate bench``: check the arguments, run the lanes, print the table."""

from __future__ import annotations

import argparse
import json

from conformance.report.files import output_file, write_atomically
from conformance.run.usage import UsageError, validate


def cmd_bench(args: argparse.Namespace) -> int:
    from conformance.bench.lanes import parse_batch_sizes
    from conformance.bench.measure import run_bench
    from conformance.bench.result import format_table
    from conformance.report.progress import Steps
    from conformance.run.device import best_graphs, device_problem

    graphs = best_graphs(args.graphs, args.device)
    problem = device_problem(args.device, graphs)
    if problem:
        raise UsageError(problem)
    backends = [b for b in (args.backends or ("refengine,hf" if args.spec == "none"
                                               else "refengine")).split(",") if b]
    loaded = validate(args.spec, backends, args.model, args.draft_model)
    if graphs and not any(b.capabilities().graph_runner for b in loaded):
        if args.graphs != "auto":  # asked for by name: say why it cannot be had
            raise UsageError(f"--graphs: none of {', '.join(backends)} claims graph_runner")
        graphs = None  # the default: graph lanes for the backends that have a graph runner
    json_path = output_file(args.json) if args.json else None
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        with Steps("bench", len(batch_sizes)) as steps:
            result = run_bench(backends=backends, batch_sizes=batch_sizes,
                               max_new_tokens=args.max_new_tokens, spec=args.spec,
                               progress=steps, model=args.model, draft_model=args.draft_model,
                               min_requests=args.min_requests, repeats=args.repeats,
                               graphs=graphs, device=args.device)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(format_table(result))
    if json_path is not None:
        from dataclasses import asdict
        write_atomically(json_path, json.dumps(asdict(result), indent=1) + "\n")
    return 0
