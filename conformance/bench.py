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
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from conformance.adapter import (
    Backend,
    EngineHandle,
    FinishEvent,
    OpenConfig,
    Request,
    SpecConfig,
)
from conformance.golden import summarize
from conformance.prompts import load_prompt_set
from conformance.specs import SPECS, config_id
from refengine.config import SamplingParams

_WARMUP_TOKENS = 4
_MAX_IDLE_STEPS = 10_000


@dataclass
class BackendTiming:
    """One backend at one batch size."""

    tokens_per_s: float
    total_tokens: int
    seconds: float
    tau: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class BenchRow:
    batch_size: int
    results: dict[str, BackendTiming] = field(default_factory=dict)  # backend spec -> timing


@dataclass
class BenchResult:
    """Everything ``format_table`` prints; ``dataclasses.asdict`` gives plain JSON data."""

    spec: str
    model: str
    max_new_tokens: int
    threads: int
    backends: list[str]                # lane labels: backend names, or "plain" / config ids
    versions: dict[str, str]           # lane label -> "<name> <version>"
    repeats: int = 1                   # runs per group and lane; the fastest one counts
    rows: list[BenchRow] = field(default_factory=list)
    # With a spec: the lanes of further backends, decoding plainly as yardsticks beside it.
    yardsticks: list[str] = field(default_factory=list)


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; ValueError naming the flag on anything else."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes: expected comma-separated integers, got {text!r}") \
            from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes: expected integers >= 1, got {text!r}")
    return sizes


def load_prompts(model: str, count: int) -> list[tuple[int, ...]]:
    """The first ``count`` default prompts as token ids, cycling through the set if needed."""
    cases = load_prompt_set("default", model)
    if not cases:
        raise ValueError("prompt set 'default' is empty")
    return [cases[i % len(cases)].ids for i in range(count)]


@dataclass(frozen=True)
class Lane:
    """One column of the table: a backend, run with one spec configuration (None = plain)."""

    label: str
    backend: str
    spec: SpecConfig | None
    graphs: str | None = None  # the backend's graph executor (None: eager)


def with_graph_lanes(lanes: list[Lane], graphs: str, claims: Callable[[str], bool]
                     ) -> list[Lane]:
    """Each lane of a backend that ``claims`` a graph runner, followed by its twin running
    through it (label ``<lane>+<executor>``), so the two are timed side by side."""
    out: list[Lane] = []
    for lane in lanes:
        out.append(lane)
        if claims(lane.backend):
            out.append(replace(lane, label=f"{lane.label}+{graphs}", graphs=graphs))
    return out


def lanes_for(spec: str, backends: list[str]) -> list[Lane]:
    if spec == "none":
        return [Lane(b, b, None) for b in backends]
    if spec not in SPECS:
        raise ValueError(f"--spec: {spec!r} not supported by bench (supported: "
                         f"{', '.join(SPECS)})")
    lanes = [Lane("plain", backends[0], None)]
    for c in SPECS[spec].configs:
        assert c is not None
        twin = twin_of(c)
        if twin is not None:
            lanes.append(Lane(config_id(twin), backends[0], twin))
        lanes.append(Lane(config_id(c), backends[0], c))
    return lanes + [Lane(b, b, None) for b in backends[1:]]


def twin_of(config: SpecConfig) -> SpecConfig | None:
    """What a configuration is judged beside: overlap scheduling beside its sequential twin,
    Frozen-KV MTP beside EAGLE at the same shape (equal N); None for the rest."""
    if config.overlap:
        return replace(config, overlap=False)
    if config.algorithm == "frozen_kv_mtp":
        return replace(config, algorithm="eagle", draft_model="tiny-code-eagle")
    return None


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
        from conformance.registry import load_backend  # lazy: the CLI imports this module early
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
                kv_pool_tokens=max(OpenConfig.kv_pool_tokens, pool),
                max_running_requests=max(OpenConfig.max_running_requests, biggest)))
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


def format_table(result: BenchResult) -> str:
    """Tokens/s per batch size and lane, with the ratios of ``ratio_pairs``."""
    header = (f"specgate bench: spec={result.spec}  model={result.model}  "
              f"max_new_tokens={result.max_new_tokens}  torch threads={result.threads}"
              + (f"  repeats={result.repeats} (fastest kept)" if result.repeats > 1 else ""))
    lines = [header]
    lines.extend(f"  {name}: {result.versions.get(name, '?')}" for name in result.backends)
    pairs = ratio_pairs(result)
    columns = ["batch", *(f"{name} tok/s" for name in result.backends),
               *(f"{a}/{b}" for a, b in pairs)]
    cells = [[str(row.batch_size),
              *(f"{row.results[n].tokens_per_s:,.1f}" for n in result.backends),
              *(_ratio(row.results[a].tokens_per_s, row.results[b].tokens_per_s)
                for a, b in pairs)]
             for row in result.rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
    lines.extend(yardstick_lines(result))
    details = [(row.batch_size, label, t) for row in result.rows
               for label, t in row.results.items() if t.tau is not None or t.phase_seconds]
    if details:
        lines.append("")
        lines.append("per lane: tau (tokens per verify, bonus included), per-position "
                     "acceptance, seconds per phase")
        for b, label, t in details:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t.phase_seconds.items()) if v)
            tau = "" if t.tau is None else (f"tau {t.tau:.2f}  acceptance "
                                            f"{[round(a, 2) for a in t.per_position_acceptance]}  ")
            lines.append(f"  batch {b:>3} {label}: {tau}{phases}")
    return "\n".join(lines)


def ratio_pairs(result: BenchResult) -> list[tuple[str, str]]:
    """(numerator, denominator) lanes of the table's ratio columns. With a spec: each
    configuration over plain decoding (its speedup). With ``--spec none``: each graph twin of
    the first backend over its eager lane, then each of the first backend's lanes over each
    other backend (so "refengine+compiled/hf" is read off, not worked out)."""
    first, others = result.backends[0], result.backends[1:]
    if result.spec != "none":
        return [(n, first) for n in others]
    twins = [n for n in others if n.startswith(f"{first}+")]
    foreign = [n for n in others if n not in twins]
    return [(t, first) for t in twins] + [(own, f) for own in (first, *twins) for f in foreign]


def yardstick_lines(result: BenchResult) -> list[str]:
    """With a spec and further backends: per batch size, the first backend's fastest lane
    over each of them (e.g. speculation with graphs against a C++ engine's plain decoding)."""
    if not result.yardsticks:
        return []
    own = [n for n in result.backends if n not in result.yardsticks]
    lines = [""]
    for row in result.rows:
        best = max(own, key=lambda n: row.results[n].tokens_per_s)
        speed = row.results[best].tokens_per_s
        over = ", ".join(f"{_ratio(speed, row.results[y].tokens_per_s)} {y}"
                         for y in result.yardsticks)
        lines.append(f"batch {row.batch_size}: fastest lane {best} ({speed:,.1f} tok/s) = {over}")
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"
