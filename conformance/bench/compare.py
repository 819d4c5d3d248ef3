"""The table of ``specgate bench --spec chains`` (``isolated.IsolatedBench``): a row per
backend, lane and batch size with tok/s, tau, ms per step, start-up and whether the outputs
equal the reference backend's; then each lane's details, and per batch size the reference
backend's best lane against each other backend's best lane, measured side by side in one run.

Outputs are compared token for token per prompt (greedy, every lane decodes the same prompts
in the same groups) against the reference backend's eager lane of the same configuration and
batch size; a lane the reference backend has no twin for is not compared.
"""

from __future__ import annotations

from conformance.bench.isolated import IsolatedBench, LaneRun
from conformance.bench.result import DETAILS_HEADING, BackendTiming, aligned, detail, ratio


def reference_backend(backends: list[str]) -> str:
    """The backend others are compared with: the reference engine if it runs, else the first."""
    return "refengine" if "refengine" in backends else backends[0]


def outputs_verdict(reference: list[list[int]], got: list[list[int]]) -> str:
    """``same``, or ``N of M differ`` counting the prompts whose tokens differ at all."""
    if len(reference) != len(got):
        raise ValueError(f"outputs of {len(got)} requests against {len(reference)}")
    differ = sum(a != b for a, b in zip(reference, got, strict=True))
    return "same" if differ == 0 else f"{differ} of {len(reference)} differ"


def timing(run: LaneRun, batch_size: int) -> BackendTiming:
    row = next(r for r in run.result.rows if r.batch_size == batch_size)
    return row.results[run.lane]


def _verdict(bench: IsolatedBench, run: LaneRun, batch_size: int) -> str:
    config = run.lane.partition("+")[0]  # a graph twin is held to its eager lane's outputs
    if run.backend == bench.reference and run.lane == config:
        return "reference"
    ref = next((r for r in bench.runs if r.backend == bench.reference and r.lane == config),
               None)
    if ref is None:
        return "-"
    return outputs_verdict(timing(ref, batch_size).outputs, timing(run, batch_size).outputs)


def _cells(bench: IsolatedBench, run: LaneRun, batch_size: int) -> list[str]:
    t = timing(run, batch_size)
    ms = f"{1000 * t.seconds / t.steps:.2f}" if t.steps else "-"
    return [run.backend, run.lane, str(batch_size), f"{t.tokens_per_s:,.1f}",
            "-" if t.tau is None else f"{t.tau:.2f}", ms,
            f"{run.result.open_seconds[run.lane]:.2f}", _verdict(bench, run, batch_size)]


def best_lane_lines(bench: IsolatedBench) -> list[str]:
    """Per batch size: the reference backend's fastest lane over each other backend's."""
    lines = []
    for b in bench.batch_sizes:
        best = {}
        for backend in bench.backends:
            runs = [r for r in bench.runs if r.backend == backend]
            if runs:
                fastest = max(runs, key=lambda r: timing(r, b).tokens_per_s)
                best[backend] = (fastest.lane, timing(fastest, b).tokens_per_s)
        if bench.reference not in best:
            continue
        lane, speed = best[bench.reference]
        lines.extend(f"batch {b}: {bench.reference}'s best lane {lane} ({speed:,.1f} tok/s) = "
                     f"{ratio(speed, other_speed)} {other}'s best lane {other_lane} "
                     f"({other_speed:,.1f} tok/s)"
                     for other, (other_lane, other_speed) in best.items()
                     if other != bench.reference)
    return lines


def format_isolated(bench: IsolatedBench) -> str:
    first = bench.runs[0].result if bench.runs else None
    header = (f"specgate bench: spec=chains  model={bench.model}  max_new_tokens="
              f"{bench.max_new_tokens}  requests per batch size >= {bench.min_requests}"
              + (f"  repeats={bench.repeats} (fastest kept)" if bench.repeats > 1 else "")
              + (f"  device={first.device}" if first and first.device != "cpu" else ""))
    lines = [header, f"each (backend, lane) in a process of its own; EAGLE head "
                     f"{bench.eagle_head}; outputs against {bench.reference}'s same lane"]
    versions = {r.backend: (r.result.versions[r.lane], r.result.threads) for r in bench.runs}
    lines.extend(f"  {backend}: {version}, torch threads {threads}"
                 for backend, (version, threads) in versions.items())
    columns = ["backend", "lane", "batch", "tok/s", "tau", "ms/step", "start-up s", "outputs"]
    cells = [_cells(bench, run, b) for b in bench.batch_sizes for run in bench.runs]
    lines.extend(aligned(columns, cells, left_first=True))
    details = [(b, run, timing(run, b)) for b in bench.batch_sizes for run in bench.runs]
    details = [(b, run, t) for b, run, t in details if t.tau is not None or t.phase_seconds]
    if details:
        lines += ["", DETAILS_HEADING]
        lines.extend(f"  batch {b:>3} {run.backend} {run.lane}: {detail(t)}"
                     for b, run, t in details)
    summary = best_lane_lines(bench)
    return "\n".join([*lines, *(["", *summary] if summary else [])])
