"""What a bench run compares: its lanes (a backend with one spec configuration, eager or
through its graph runner), batch sizes and prompts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from conformance.contract import SpecConfig
from conformance.run.prompts import load_prompt_set
from conformance.run.specs import SPECS, config_id


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
    Frozen-KV MTP and n-gram lookup beside EAGLE at the same shape (equal N); None for the
    rest."""
    if config.overlap:
        return replace(config, overlap=False)
    if config.algorithm in ("frozen_kv_mtp", "ngram"):
        return replace(config, algorithm="eagle", draft_model="tiny-code-eagle")
    return None
