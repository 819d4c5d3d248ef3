"""What a bench run measured (``BenchResult``, plain JSON through ``dataclasses.asdict``) and
the table ``specgate bench`` prints from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BackendTiming:
    """One backend at one batch size."""

    tokens_per_s: float
    total_tokens: int
    seconds: float
    tau: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    steps: int = 0                       # handle.step() calls in the timed runs
    # On a CUDA device (None elsewhere): the kernels' device time over the same groups (a
    # profiled pass), the GPU memory the lane holds and the peak allocated while it ran (all
    # lanes' memory included), and for a graph lane what its graph shapes' first use cost
    # (capture or compile) beyond the timed run.
    device_seconds: float | None = None
    held_gpu_bytes: int | None = None
    peak_gpu_bytes: int | None = None
    capture_seconds: float | None = None
    # Each request's generated tokens, in prompt order (the groups' fastest runs), so runs in
    # other processes can be compared token for token.
    outputs: list[list[int]] = field(default_factory=list)


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
    device: str = "cpu"                # where the backends ran: "cpu" or the CUDA device's name
    open_seconds: dict[str, float] = field(default_factory=dict)  # lane label -> open() wall

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """The inverse of ``dataclasses.asdict`` (how a bench worker's result comes back)."""
        rows = [BenchRow(r["batch_size"], {label: BackendTiming(**t)
                                           for label, t in r["results"].items()})
                for r in data["rows"]]
        return cls(**{**data, "rows": rows})


# Up to this many lanes are columns of the tokens/s table, and up to this many ratios columns
# beside them; more (a spec's lanes with graph twins beside a yardstick) turn the table: a row
# per lane, and the ratios a table of their own, a row per ratio.
INLINE_LANES = 4
INLINE_RATIOS = 3


def format_table(result: BenchResult) -> str:
    """Tokens/s per batch size and lane, with the ratios of ``ratio_pairs``."""
    header = (f"specgate bench: spec={result.spec}  model={result.model}  "
              f"max_new_tokens={result.max_new_tokens}  torch threads={result.threads}"
              + (f"  repeats={result.repeats} (fastest kept)" if result.repeats > 1 else "")
              + (f"  device={result.device}" if result.device != "cpu" else ""))
    lines = [header]
    lines.extend(f"  {name}: {result.versions.get(name, '?')}" for name in result.backends)
    pairs = ratio_pairs(result)
    inline = pairs if len(pairs) <= INLINE_RATIOS else []
    if len(result.backends) <= INLINE_LANES:
        columns = ["batch", *(f"{name} tok/s" for name in result.backends),
                   *(f"{a}/{b}" for a, b in inline)]
        cells = [[str(row.batch_size),
                  *(f"{row.results[n].tokens_per_s:,.1f}" for n in result.backends),
                  *(ratio(row.results[a].tokens_per_s, row.results[b].tokens_per_s)
                    for a, b in inline)]
                 for row in result.rows]
        lines.extend(aligned(columns, cells))
    else:  # one row per lane, one column per batch size
        inline = []
        lines.extend(aligned(["lane", *(f"batch {row.batch_size} tok/s" for row in result.rows)],
                              [[name, *(f"{row.results[name].tokens_per_s:,.1f}"
                                        for row in result.rows)] for name in result.backends],
                              left_first=True))
    if pairs and not inline:  # one row per ratio, one column per batch size
        lines.append("")
        lines.extend(aligned(["ratio", *(f"batch {row.batch_size}" for row in result.rows)],
                              [[f"{a}/{b}", *(ratio(row.results[a].tokens_per_s,
                                                     row.results[b].tokens_per_s)
                                              for row in result.rows)] for a, b in pairs],
                              left_first=True))
    lines.extend(yardstick_lines(result))
    details = [(row.batch_size, label, t) for row in result.rows
               for label, t in row.results.items() if t.tau is not None or t.phase_seconds]
    if details:
        lines.append("")
        lines.append(DETAILS_HEADING)
        lines.extend(f"  batch {b:>3} {label}: {detail(t)}" for b, label, t in details)
    lines.extend(device_lines(result) or first_use_lines(result))
    return "\n".join(lines)


DETAILS_HEADING = ("per lane: tau (tokens per verify, bonus included), per-position acceptance, "
                   "seconds per phase")


def detail(t: BackendTiming) -> str:
    """A lane's tau, per-position acceptance and seconds per phase (those it has)."""
    phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t.phase_seconds.items()) if v)
    tau = "" if t.tau is None else (f"tau {t.tau:.2f}  acceptance "
                                    f"{[round(a, 2) for a in t.per_position_acceptance]}  ")
    return (tau + phases).rstrip()


def first_use_lines(result: BenchResult) -> list[str]:
    """Per batch size, what each graph lane's first use of its shapes cost beyond its timed
    run: compiling, building or loading its keys (on a GPU ``device_lines`` has it)."""
    costs = [f"batch {row.batch_size} {label} {t.capture_seconds:.2f} s"
             for row in result.rows for label, t in row.results.items()
             if t.capture_seconds is not None]
    if not costs:
        return []
    return ["", "first use of each graph lane's shapes (compile, build or load), beyond its "
            "timed run: " + ", ".join(costs)]


def step_split(t: BackendTiming) -> dict[str, float]:
    """Milliseconds per engine step: ``schedule`` (the engine's schedule phase), ``forwards``
    (its forward phases: prefill, decode, draft, verify, extend; wall time, which on a GPU
    includes waiting for the device where a phase reads its result), ``resolve`` (the rest of
    the step: resolve, bookkeeping, the adapter) and, on a CUDA device, ``device`` (the
    kernels' device time) with ``host share`` (the fraction of the step's wall time the
    device was not computing, in percent). Empty where the backend reports no steps."""
    if t.steps < 1:
        return {}
    ms = 1000 / t.steps
    schedule = t.phase_seconds.get("schedule", 0.0)
    forwards = sum(v for k, v in t.phase_seconds.items() if k != "schedule")
    split = {"step": t.seconds * ms}
    if t.phase_seconds:
        split |= {"schedule": schedule * ms, "forwards": forwards * ms,
                  "resolve": max(0.0, t.seconds - schedule - forwards) * ms}
    if t.device_seconds is not None and t.seconds > 0:
        split |= {"device": t.device_seconds * ms,
                  "host share": 100 * max(0.0, 1 - t.device_seconds / t.seconds)}
    return split


def device_lines(result: BenchResult) -> list[str]:
    """On a CUDA device: per batch size and lane, the step split (``step_split``), the graph
    shapes' capture cost and the peak GPU memory."""
    if result.device == "cpu":
        return []
    lines = ["", f"on {result.device}: ms per step (schedule / forwards / resolve; device: the "
             "kernels' time, profiled), host share of a step, capture cost, GPU memory the "
             "lane holds, peak allocated (every lane's included)"]
    for row in result.rows:
        for label, t in row.results.items():
            split = ", ".join(f"{k} {v:.1f}%" if k == "host share" else f"{k} {v:.3f}"
                              for k, v in step_split(t).items())
            capture = ("" if t.capture_seconds is None
                       else f", capture {t.capture_seconds:.2f} s")
            memory = "".join(f", {what} {n / 2**20:,.1f} MiB" for what, n in (
                ("holds", t.held_gpu_bytes), ("peak", t.peak_gpu_bytes)) if n is not None)
            lines.append(f"  batch {row.batch_size:>3} {label}: {split}{capture}{memory}")
    return lines


def aligned(columns: list[str], cells: list[list[str]], left_first: bool = False) -> list[str]:
    """A header, a rule and the rows, columns right-aligned (the first left-aligned if asked)."""
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(columns)]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if left_first and i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True)))
    return [line(columns), "  ".join("-" * w for w in widths), *(line(r) for r in cells)]


def ratio_pairs(result: BenchResult) -> list[tuple[str, str]]:
    """(numerator, denominator) lanes of the table's ratio columns. With a spec: each eager
    configuration over plain decoding (its speedup); each graph twin over its eager lane, and
    a configuration's graph twin over plain decoding's graph twin (the speedup with graphs);
    each overlap (V2) lane over its sequential (V1) twin; plain decoding's graph twin over each
    yardstick. With ``--spec none``: each graph twin of
    the first backend over its eager lane, then each of the first backend's lanes over each
    other backend (so "refengine+compiled/hf" is read off, not worked out)."""
    first, others = result.backends[0], result.backends[1:]
    if result.spec != "none":
        pairs: list[tuple[str, str]] = []
        for n in others:
            eager, plus, graphs = n.partition("+")
            if not plus or eager not in result.backends:
                pairs.append((n, first))
                continue
            pairs.append((n, eager))
            if eager != first and f"{first}+{graphs}" in result.backends:
                pairs.append((n, f"{first}+{graphs}"))
        for n in others:  # overlap scheduling (V2) beside its sequential twin (V1)
            eager, plus, graphs = n.partition("+")
            sequential = eager.removesuffix("-v2") + plus + graphs
            if eager.endswith("-v2") and sequential in result.backends:
                pairs.append((n, sequential))
        plain_twins = [n for n in others if n.startswith(f"{first}+")]
        return pairs + [(t, y) for t in plain_twins for y in result.yardsticks]
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
        over = ", ".join(f"{ratio(speed, row.results[y].tokens_per_s)} {y}"
                         for y in result.yardsticks)
        lines.append(f"batch {row.batch_size}: fastest lane {best} ({speed:,.1f} tok/s) = {over}")
    return lines


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"
