"""What a bench run measured (``BenchResult``, plain JSON through ``dataclasses.asdict``) and
the table ``specgate bench`` prints from it."""

from __future__ import annotations

from dataclasses import dataclass, field


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
