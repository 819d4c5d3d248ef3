"""``specgate bench``: generated tokens/s of backends side by side, through the adapter.

Every backend is driven exactly as the suite drives it (submit, then step until every request
has finished), in the same process and on the same prompts, so the numbers compare the engines
rather than the harnesses. Only plain decoding (``--spec none``) is measured for now.

The workload is fixed so runs are comparable: the first ``b`` prompts of
``fixtures/prompts/default.jsonl`` (cycled when ``b`` exceeds the file), greedy, ``ignore_eos``
and a fixed ``max_new_tokens``, so every request emits the same number of tokens on every
backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from conformance.adapter import Backend, EngineHandle, FinishEvent, OpenConfig, Request
from conformance.prompts import load_prompt_set
from refengine.config import SamplingParams

SUPPORTED_SPECS = ("none",)
_WARMUP_TOKENS = 4
_MAX_IDLE_STEPS = 10_000


@dataclass
class BackendTiming:
    """One backend at one batch size."""

    tokens_per_s: float
    total_tokens: int
    seconds: float


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
    backends: list[str]                # as requested: "refengine", "hf", or "module:factory"
    versions: dict[str, str]           # backend spec -> "<name> <version>"
    rows: list[BenchRow] = field(default_factory=list)


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


def _run_batch(handle: EngineHandle, prompts: list[tuple[int, ...]], max_new_tokens: int,
               tag: str) -> tuple[int, float]:
    """Submit ``prompts`` and step until all finish: (output tokens, wall seconds)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    pending = set(rids)
    tokens = idle = 0
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        handle.submit(Request(rid, ids, params))
    while pending:
        events = handle.step()
        for ev in events:
            if isinstance(ev, FinishEvent) and ev.rid in pending:
                pending.discard(ev.rid)
                tokens += len(ev.output_ids)
        # A step may legitimately report nothing (a chunked prefill), but not forever.
        idle = 0 if events else idle + 1
        if idle > _MAX_IDLE_STEPS:
            raise RuntimeError(f"bench: backend made no progress in {_MAX_IDLE_STEPS} steps "
                               f"with {len(pending)} requests unfinished")
    return tokens, time.perf_counter() - start


def run_bench(backends: list[str], batch_sizes: list[int], max_new_tokens: int, spec: str,
              progress: Callable[[str], None], model: str = "tiny-code",
              loader: Callable[[str], Backend] | None = None) -> BenchResult:
    """Time each backend on each batch size; ``loader`` defaults to the backend registry.

    Backends are opened once and warmed up once (batch 1, a few tokens: first-call allocations
    and lazy initialisation are not what we measure); the timed region is submit + step.
    """
    if spec not in SUPPORTED_SPECS:
        raise ValueError(f"--spec: {spec!r} not supported by bench yet "
                         f"(supported: {', '.join(SUPPORTED_SPECS)})")
    if not backends:
        raise ValueError("--backends: at least one backend is needed")
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends: duplicates in {backends}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"--batch-sizes: expected integers >= 1, got {batch_sizes}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if loader is None:
        from conformance.registry import load_backend  # lazy: the CLI imports this module early
        loader = load_backend

    prompts = load_prompts(model, max(batch_sizes))
    biggest = max(batch_sizes)
    # Room for the whole largest batch at once, so a paged backend never retracts mid-bench.
    pool = sum(len(p) + max_new_tokens for p in prompts[:biggest]) + biggest
    cfg = OpenConfig(model=model, kv_pool_tokens=max(OpenConfig.kv_pool_tokens, pool),
                     max_running_requests=max(OpenConfig.max_running_requests, biggest))

    result = BenchResult(spec=spec, model=model, max_new_tokens=max_new_tokens,
                         threads=torch.get_num_threads(), backends=list(backends), versions={})
    handles: dict[str, EngineHandle] = {}
    try:
        for name in backends:
            backend = loader(name)
            result.versions[name] = f"{backend.name} {backend.version}"
            progress(f"opening {name} ({result.versions[name]}) on {model}")
            handles[name] = backend.open(cfg)
            _run_batch(handles[name], prompts[:1], _WARMUP_TOKENS, "warmup")
        for b in batch_sizes:
            row = BenchRow(batch_size=b)
            for name, handle in handles.items():
                tokens, seconds = _run_batch(handle, prompts[:b], max_new_tokens, f"b{b}")
                row.results[name] = BackendTiming(tokens / seconds if seconds > 0 else 0.0,
                                                  tokens, seconds)
                progress(f"batch {b:>3}: {name} {row.results[name].tokens_per_s:,.1f} tok/s "
                         f"({tokens} tokens in {seconds:.3f} s)")
            result.rows.append(row)
    finally:
        for handle in handles.values():
            handle.close()
    return result


def format_table(result: BenchResult) -> str:
    """Tokens/s per batch size and backend, plus the first backend's speed over each other's."""
    first, others = result.backends[0], result.backends[1:]
    header = (f"specgate bench: spec={result.spec}  model={result.model}  "
              f"max_new_tokens={result.max_new_tokens}  torch threads={result.threads}")
    lines = [header]
    lines.extend(f"  {name}: {result.versions.get(name, '?')}" for name in result.backends)
    columns = ["batch", *(f"{name} tok/s" for name in result.backends),
               *(f"{first}/{name}" for name in others)]
    cells = [[str(row.batch_size),
              *(f"{row.results[n].tokens_per_s:,.1f}" for n in result.backends),
              *(_ratio(row.results[first].tokens_per_s, row.results[n].tokens_per_s)
                for n in others)]
             for row in result.rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"
