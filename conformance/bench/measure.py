"""``specgate bench``: generated tokens/s of backends side by side, through the adapter.

Every backend is driven exactly as the suite drives it (submit, then step until every request
has finished), in the same process and on the same prompts, so the numbers compare the engines
rather than the harnesses.

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
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from conformance.bench.lanes import lanes_for, load_prompts, with_graph_lanes
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


def _run_batch(handle: EngineHandle, prompts: list[tuple[int, ...]], max_new_tokens: int,
               tag: str) -> tuple[int, float, list[list[int]]]:
    """Submit ``prompts`` and step until all finish: (tokens, wall seconds, accept_lens)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    pending = set(rids)
    tokens = idle = 0
    accepts: list[list[int]] = []
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        handle.submit(Request(rid, ids, params))
    while pending:
        events = handle.step()
        for ev in events:
            if isinstance(ev, FinishEvent) and ev.rid in pending:
                pending.discard(ev.rid)
                tokens += len(ev.output_ids)
                accepts.append(list(ev.accept_lens))
        # A step may legitimately report nothing (a chunked prefill), but not forever.
        idle = 0 if events else idle + 1
        if idle > _MAX_IDLE_STEPS:
            raise RuntimeError(f"bench: backend made no progress in {_MAX_IDLE_STEPS} steps "
                               f"with {len(pending)} requests unfinished")
    return tokens, time.perf_counter() - start, accepts


def _phase_seconds(handle: EngineHandle) -> dict[str, float]:
    """The reference engine's per-phase wall time so far (empty for other backends)."""
    engine = getattr(handle, "engine", None)
    return dict(getattr(engine, "phase_seconds", {}))


@dataclass
class GroupRun:
    """One lane on one group of prompts."""

    tokens: int
    seconds: float
    accept_lens: list[list[int]]     # per request
    phase_seconds: dict[str, float]


def _fastest(tries: list[GroupRun]) -> GroupRun:
    """The fastest of one lane's repeats of a group. Greedy decoding is deterministic, so
    every repeat must emit the same tokens; a backend whose repeats differ is not comparable
    run to run, and picking one of them would hide that."""
    if any(t.tokens != tries[0].tokens or t.accept_lens != tries[0].accept_lens
           for t in tries):
        raise RuntimeError("bench: repeats of one group emitted different token counts or "
                           "acceptance; greedy decoding should be deterministic")
    return min(tries, key=lambda t: t.seconds)


def _timing(runs: list[GroupRun], spec: SpecConfig | None) -> BackendTiming:
    """One lane's groups at one batch size, pooled: tokens and seconds summed, tau over every
    request, seconds per phase summed."""
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    accepts = [a for r in runs for a in r.accept_lens]
    phases: dict[str, float] = {}
    for r in runs:
        for k, v in r.phase_seconds.items():
            phases[k] = phases.get(k, 0.0) + v
    stats = summarize(accepts, spec.num_steps) if spec else {}
    return BackendTiming(tokens / seconds if seconds > 0 else 0.0, tokens, seconds,
                         stats.get("mean_tau"), list(stats.get("per_position_acceptance", [])),
                         {k: round(v, 4) for k, v in phases.items()})


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
              repeats: int = 1, graphs: str | None = None) -> BenchResult:
    """Time each backend on each batch size; ``loader`` defaults to the backend registry.

    Backends are opened once and warmed up once (batch 1, a few tokens: first-call allocations
    and lazy initialisation are not what we measure); the timed region is submit + step.
    ``graphs``: every backend claiming a graph runner also runs through it, in its own lane;
    such a lane runs each batch size's groups once untimed first (a compiled executor
    compiles a shape, batch bucket and key width, on its first use: a cost per machine,
    reported, not timed).
    """
    if not backends:
        raise ValueError("--backends: at least one backend is needed")
    lanes = lanes_for(spec, backends)
    if draft_model:
        lanes = [ln if ln.spec is None
                 else replace(ln, spec=replace(ln.spec, draft_model=draft_model)) for ln in lanes]
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends: duplicates in {backends}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes: expected integers >= 1, got {batch_sizes}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if min_requests < 1:
        raise ValueError(f"--min-requests: must be >= 1, got {min_requests}")
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    if loader is None:
        from conformance.run.registry import load_backend  # lazy: the CLI imports this module early
        loader = load_backend
    if graphs:
        load = loader
        lanes = with_graph_lanes(lanes, graphs, lambda b: load(b).capabilities().graph_runner)

    groups = {b: math.ceil(min_requests / b) for b in batch_sizes}
    prompts = load_prompts(model, max(b * g for b, g in groups.items()))
    biggest = max(batch_sizes)
    # Room for the longest prompts of the largest batch plus a speculative step's reserve each,
    # so a paged backend never retracts mid-bench.
    longest = sorted((len(p) for p in prompts), reverse=True)[:biggest]
    pool = sum(n + max_new_tokens + 64 for n in longest) + biggest
    result = BenchResult(spec=spec, model=model, max_new_tokens=max_new_tokens,
                         threads=torch.get_num_threads(), backends=[ln.label for ln in lanes],
                         versions={}, repeats=repeats,
                         yardsticks=[] if spec == "none" else backends[1:])
    handles: dict[str, EngineHandle] = {}
    try:
        for lane in lanes:
            backend = loader(lane.backend)
            result.versions[lane.label] = f"{backend.name} {backend.version}"
            progress.note(f"opening {lane.label} ({result.versions[lane.label]}) on {model}")
            handles[lane.label] = backend.open(OpenConfig(
                model=model, spec=lane.spec, graph_executor=lane.graphs,
                kv_pool_tokens=max(EngineConfig.kv_pool_tokens, pool),
                max_running_requests=max(EngineConfig.max_running_requests, biggest)))
            _run_batch(handles[lane.label], prompts[:1], _WARMUP_TOKENS, "warmup")
        for b in batch_sizes:
            progress.start(f"batch {b} ({groups[b]} group(s) x {repeats} repeat(s))")
            row = BenchRow(batch_size=b)
            for lane in lanes:
                if lane.graphs:
                    start = time.perf_counter()
                    for g in range(groups[b]):
                        _run_batch(handles[lane.label], prompts[g * b:(g + 1) * b],
                                   max_new_tokens, f"b{b}g{g}warmup")
                    progress.note(f"{lane.label}: batch {b} warm-up (first use of its graph "
                                  f"shapes) {time.perf_counter() - start:.1f} s, untimed")
            runs: dict[str, list[GroupRun]] = {lane.label: [] for lane in lanes}
            for g in range(groups[b]):
                tries: dict[str, list[GroupRun]] = {lane.label: [] for lane in lanes}
                for r in range(repeats):
                    for lane in lanes:
                        handle = handles[lane.label]
                        before = _phase_seconds(handle)
                        tokens, seconds, accepts = _run_batch(
                            handle, prompts[g * b:(g + 1) * b], max_new_tokens,
                            f"b{b}g{g}r{r}")
                        phases = {k: v - before.get(k, 0.0)
                                  for k, v in _phase_seconds(handle).items()}
                        tries[lane.label].append(GroupRun(tokens, seconds, accepts, phases))
                for lane in lanes:
                    runs[lane.label].append(_fastest(tries[lane.label]))
            for lane in lanes:
                row.results[lane.label] = _timing(runs[lane.label], lane.spec)
            progress.done(", ".join(f"{label} {t.tokens_per_s:,.1f} tok/s ({t.total_tokens} "
                                    f"tokens in {t.seconds:.3f} s)"
                                    for label, t in row.results.items()))
            result.rows.append(row)
    finally:
        for handle in handles.values():
            handle.close()
    return result
