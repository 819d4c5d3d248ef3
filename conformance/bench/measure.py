"""``specgate bench``: generated tokens/s of backends side by side, through the adapter.

Every backend is driven exactly as the suite drives it (submit, then step until every request
has finished), in the same process and on the same prompts, so the numbers compare the engines
rather than the harnesses. (``--spec chains`` runs each lane alone in a process of its own
instead, through ``run_lanes``: ``conformance.bench.isolated``.)

``--spec none`` compares backends on plain decoding. ``--spec eagle|eagle-tree`` compares the
first backend's plain decoding with each configuration of that spec (and any further backend's
plain decoding, e.g. a C++ engine as the yardstick), side by side: tokens/s,
speedup, tau (tokens per verify, bonus included), per-position acceptance and — for the
reference engine — where the time goes (schedule / prefill / draft / verify / extend).

The workload is fixed so runs are comparable: greedy, ``ignore_eos`` and a fixed
``max_new_tokens``, so every request emits the same number of tokens on every backend. Batch
size ``b`` runs ``ceil(min_requests / b)`` groups of ``b`` prompts, taken in order from
``fixtures/prompts/default.jsonl`` (cycled): batch 1 then measures several prompts rather than
whichever happens to come first. Lanes take turns group by group, so slow drifts of a noisy
machine fall on every lane alike. With ``repeats`` > 1 every lane runs every group that many
times (the lanes still taking turns) and keeps its fastest run of the group, as ``timeit``
does: on a shared machine interference only ever adds time, so the minimum is the estimate
least disturbed by it, and it is taken the same way for every lane.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from conformance.bench.device import DeviceMeter
from conformance.bench.lanes import (
    Lane,
    Workload,
    lanes_for,
    load_prompts,
    with_draft_model,
    with_graph_lanes,
)
from conformance.bench.result import BackendTiming, BenchResult, BenchRow
from conformance.checks.golden import summarize
from conformance.contract import (
    Backend,
    EngineHandle,
    FinishEvent,
    OpenConfig,
    Request,
    SpecConfig,
)
from refengine.config import EngineConfig, SamplingParams

_WARMUP_TOKENS = 4
_MAX_IDLE_STEPS = 10_000


@dataclass
class BatchRun:
    """What one ``_run_batch`` took and emitted."""

    tokens: int
    seconds: float
    accept_lens: list[list[int]]     # per request
    steps: int                       # handle.step() calls
    outputs: list[list[int]]         # per request, in submission order


def _run_batch(handle: EngineHandle, prompts: list[tuple[int, ...]], max_new_tokens: int,
               tag: str, meter: DeviceMeter | None = None) -> BatchRun:
    """Submit ``prompts`` and step until all finish; the clock stops once ``meter``'s device
    has finished too."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    pending = set(rids)
    tokens = idle = steps = 0
    accepts: list[list[int]] = []
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        handle.submit(Request(rid, ids, params))
    while pending:
        events = handle.step()
        steps += 1
        for ev in events:
            if isinstance(ev, FinishEvent) and ev.rid in pending:
                pending.discard(ev.rid)
                tokens += len(ev.output_ids)
                accepts.append(list(ev.accept_lens))
                outputs[ev.rid] = list(ev.output_ids)
        # A step may legitimately report nothing (a chunked prefill), but not forever.
        idle = 0 if events else idle + 1
        if idle > _MAX_IDLE_STEPS:
            raise RuntimeError(f"bench: backend made no progress in {_MAX_IDLE_STEPS} steps "
                               f"with {len(pending)} requests unfinished")
    if meter is not None:
        meter.sync()
    return BatchRun(tokens, time.perf_counter() - start, accepts, steps,
                    [outputs[rid] for rid in rids])


def _phase_seconds(handle: EngineHandle) -> dict[str, float]:
    """The reference engine's per-phase wall time so far (empty for other backends)."""
    engine = getattr(handle, "engine", None)
    return dict(getattr(engine, "phase_seconds", {}))


@dataclass
class GroupRun:
    """One lane on one group of prompts."""

    run: BatchRun
    phase_seconds: dict[str, float]
    peak_bytes: int | None = None    # GPU memory allocated at most (CUDA)


def _fastest(tries: list[GroupRun]) -> GroupRun:
    """The fastest of one lane's repeats of a group. Greedy decoding is deterministic, so
    every repeat must emit the same tokens; a backend whose repeats differ is not comparable
    run to run, and picking one of them would hide that."""
    first = tries[0].run
    if any(t.run.tokens != first.tokens or t.run.accept_lens != first.accept_lens
           for t in tries):
        raise RuntimeError("bench: repeats of one group emitted different token counts or "
                           "acceptance; greedy decoding should be deterministic")
    return min(tries, key=lambda t: t.run.seconds)


def _timing(runs: list[GroupRun], spec: SpecConfig | None) -> BackendTiming:
    """One lane's groups at one batch size, pooled: tokens, seconds and steps summed, tau over
    every request, seconds per phase summed, the peak GPU memory of any group, the outputs in
    prompt order."""
    tokens = sum(r.run.tokens for r in runs)
    seconds = sum(r.run.seconds for r in runs)
    accepts = [a for r in runs for a in r.run.accept_lens]
    phases: dict[str, float] = {}
    for r in runs:
        for k, v in r.phase_seconds.items():
            phases[k] = phases.get(k, 0.0) + v
    stats = summarize(accepts, spec.num_steps) if spec else None
    peaks = [r.peak_bytes for r in runs if r.peak_bytes is not None]
    return BackendTiming(tokens / seconds if seconds > 0 else 0.0, tokens, seconds,
                         None if stats is None else stats["mean_tau"],
                         [] if stats is None else list(stats["per_position_acceptance"]),
                         {k: round(v, 4) for k, v in phases.items()},
                         steps=sum(r.run.steps for r in runs),
                         peak_gpu_bytes=max(peaks) if peaks else None,
                         outputs=[out for r in runs for out in r.run.outputs])


class BenchProgress(Protocol):
    """How the bench reports as it goes: each batch size is an item (``start``, ``done``);
    ``note`` is any other line (a lane being opened)."""

    def start(self, label: str) -> None: ...
    def note(self, text: str) -> None: ...
    def done(self, result: str) -> None: ...


def run_bench(backends: list[str], batch_sizes: list[int], max_new_tokens: int, spec: str,
              progress: BenchProgress, model: str = "tiny-code",
              loader: Callable[[str], Backend] | None = None,
              draft_model: str | None = None, min_requests: int = 1,
              repeats: int = 1, graphs: str | None = None, device: str = "cpu"
              ) -> BenchResult:
    """Time each backend on each batch size; ``loader`` defaults to the backend registry.

    Backends are opened once and warmed up once (batch 1, a few tokens: first-call allocations
    and lazy initialisation are not what we measure); the timed region is submit + step.
    ``graphs``: every backend claiming a graph runner also runs through it, in its own lane;
    such a lane runs each batch size's groups once untimed first (a compiled executor
    compiles a shape, batch bucket and key width, on its first use, a CUDA-graph executor
    captures it: a cost reported as ``capture_seconds``, the first pass's wall time over the
    timed one's, not timed). ``device``: where every backend runs; on CUDA each lane also gets
    its kernels' device time (``conformance.bench.device``, an untimed profiled pass), the GPU
    memory it holds (what allocation grew by while it was opened, warmed up and first used
    its graph shapes: weights, KV pool, graph pools) and the peak allocated while it ran
    (every open lane's memory included), and every timed region ends with a device
    synchronisation.
    """
    if not backends:
        raise ValueError("--backends: at least one backend is needed")
    lanes = lanes_for(spec, backends)
    if draft_model:
        lanes = with_draft_model(lanes, draft_model, spec)
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends: duplicates in {backends}")
    workload = Workload(model, tuple(batch_sizes), max_new_tokens, min_requests, repeats, device)
    if loader is None:
        from conformance.plan.registry import (
            load_backend,  # lazy: the CLI imports this module early
        )
        loader = load_backend
    if graphs:
        load = loader
        lanes = with_graph_lanes(lanes, graphs, lambda b: load(b).capabilities().graph_runner)
    return run_lanes(lanes, workload, progress, loader, spec=spec,
                     yardsticks=[] if spec == "none" else backends[1:])


def run_lanes(lanes: list[Lane], workload: Workload, progress: BenchProgress,
              loader: Callable[[str], Backend], spec: str = "none",
              yardsticks: list[str] | None = None) -> BenchResult:
    """Open every lane in this process, then time them side by side on ``workload`` (what
    ``run_bench`` does once it has planned and checked the lanes; a bench worker runs one
    lane in a process of its own). Each lane's ``open`` wall time is kept as its start-up."""
    model, batch_sizes, max_new_tokens = (workload.model, workload.batch_sizes,
                                          workload.max_new_tokens)
    groups = {b: math.ceil(workload.min_requests / b) for b in batch_sizes}
    prompts = load_prompts(model, max(b * g for b, g in groups.items()))
    biggest = max(batch_sizes)
    # Room for the longest prompts of the largest batch plus a speculative step's reserve each,
    # so a paged backend never retracts mid-bench.
    longest = sorted((len(p) for p in prompts), reverse=True)[:biggest]
    pool = sum(n + max_new_tokens + 64 for n in longest) + biggest
    meter = DeviceMeter(workload.device)
    result = BenchResult(spec=spec, model=model, max_new_tokens=max_new_tokens,
                         threads=torch.get_num_threads(), backends=[ln.label for ln in lanes],
                         versions={}, repeats=workload.repeats, yardsticks=yardsticks or [],
                         device=meter.name())
    handles: dict[str, EngineHandle] = {}
    held: dict[str, int] = {}  # GPU memory each lane's open, warm-up and first uses kept
    try:
        for lane in lanes:
            before = meter.allocated_bytes()
            backend = loader(lane.backend)
            result.versions[lane.label] = f"{backend.name} {backend.version}"
            progress.note(f"opening {lane.label} ({result.versions[lane.label]}) on {model}")
            start = time.perf_counter()
            handles[lane.label] = backend.open(OpenConfig(
                model=model, spec=lane.spec, graph_executor=lane.graphs, device=workload.device,
                kv_pool_tokens=max(EngineConfig.kv_pool_tokens, pool),
                max_running_requests=max(EngineConfig.max_running_requests, biggest)))
            result.open_seconds[lane.label] = round(time.perf_counter() - start, 4)
            _run_batch(handles[lane.label], prompts[:1], _WARMUP_TOKENS, "warmup", meter)
            _keep_growth(held, lane.label, before, meter)
        for b in batch_sizes:
            progress.start(f"batch {b} ({groups[b]} group(s) x {workload.repeats} repeat(s))")
            batches = [prompts[g * b:(g + 1) * b] for g in range(groups[b])]
            row = _batch_size_row(b, batches, lanes, handles, held, workload, meter, progress)
            progress.done(", ".join(f"{label} {t.tokens_per_s:,.1f} tok/s ({t.total_tokens} "
                                    f"tokens in {t.seconds:.3f} s)"
                                    for label, t in row.results.items()))
            result.rows.append(row)
    finally:
        for handle in handles.values():
            handle.close()
    return result


def _batch_size_row(b: int, batches: list[list[tuple[int, ...]]], lanes: list[Lane],
                    handles: dict[str, EngineHandle], held: dict[str, int], workload: Workload,
                    meter: DeviceMeter, progress: BenchProgress) -> BenchRow:
    """Batch size ``b`` on every lane: each graph lane's untimed first use of its shapes
    (``capture_seconds``: its wall time over the timed pass's), the timed groups, and on CUDA
    each lane's profiled device time."""
    max_new_tokens = workload.max_new_tokens
    first_use: dict[str, float] = {}
    for lane in (ln for ln in lanes if ln.graphs):
        before = meter.allocated_bytes()
        first_use[lane.label] = _run_groups(handles[lane.label], batches,
                                            max_new_tokens, f"b{b}warmup", meter)
        _keep_growth(held, lane.label, before, meter)
        progress.note(f"{lane.label}: batch {b} warm-up (first use of its graph "
                      f"shapes) {first_use[lane.label]:.1f} s, untimed")
    runs = _timed_groups(lanes, handles, batches, max_new_tokens, workload.repeats,
                         f"b{b}", meter)
    row = BenchRow(batch_size=b)
    for lane in lanes:
        timing = _timing(runs[lane.label], lane.spec)
        if lane.label in first_use:
            timing.capture_seconds = round(max(0.0, first_use[lane.label]
                                               - timing.seconds), 4)
        timing.held_gpu_bytes = held.get(lane.label)
        timing.device_seconds = meter.kernel_seconds(partial(
            _run_groups, handles[lane.label], batches, max_new_tokens, f"b{b}profile",
            meter))
        row.results[lane.label] = timing
    return row


def _keep_growth(held: dict[str, int], label: str, before: int | None,
                 meter: DeviceMeter) -> None:
    """Add what GPU memory grew by since ``before`` to what ``label`` holds (CUDA only)."""
    after = meter.allocated_bytes()
    if before is not None and after is not None:
        held[label] = held.get(label, 0) + after - before


def _run_groups(handle: EngineHandle, batches: list[list[tuple[int, ...]]],
                max_new_tokens: int, tag: str, meter: DeviceMeter) -> float:
    """An untimed pass over a batch size's groups (a graph lane's first use of its shapes, or
    the profiled pass); -> its wall seconds."""
    start = time.perf_counter()
    for g, group in enumerate(batches):
        _run_batch(handle, group, max_new_tokens, f"{tag}{g}", meter)
    return time.perf_counter() - start


def _timed_groups(lanes: list[Lane], handles: dict[str, EngineHandle],
                  batches: list[list[tuple[int, ...]]], max_new_tokens: int, repeats: int,
                  tag: str, meter: DeviceMeter) -> dict[str, list[GroupRun]]:
    """Every group ``repeats`` times, the lanes taking turns; per lane and group the fastest
    run."""
    runs: dict[str, list[GroupRun]] = {lane.label: [] for lane in lanes}
    for g, group in enumerate(batches):
        tries: dict[str, list[GroupRun]] = {lane.label: [] for lane in lanes}
        for r in range(repeats):
            for lane in lanes:
                handle = handles[lane.label]
                before = _phase_seconds(handle)
                meter.reset_peak()
                run = _run_batch(handle, group, max_new_tokens, f"{tag}g{g}r{r}", meter)
                phases = {k: v - before.get(k, 0.0) for k, v in _phase_seconds(handle).items()}
                tries[lane.label].append(GroupRun(run, phases, meter.peak_bytes()))
        for lane in lanes:
            runs[lane.label].append(_fastest(tries[lane.label]))
    return runs
