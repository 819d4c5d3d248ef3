"""What a bench run compares: its lanes (a backend with one spec configuration, eager or
through its graph runner), batch sizes and prompts (its ``Workload``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from conformance.contract import SpecConfig
from conformance.plan.prompts import load_prompt_set
from conformance.plan.specs import SPECS, config_id


def parse_backends(text: str) -> list[str]:
    """``"refengine,vllm"`` -> ``["refengine", "vllm"]``; ValueError naming the flag on an empty
    list or a backend named twice."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"--backends: expected comma-separated backend names, got {text!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--backends: {', '.join(twice)} named twice in {text!r}")
    return names


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


# The lanes the engine benchmarks (benchmarks/gpu_profile.py, host_overhead.py, phase_ops.py)
# name on their command lines: plain decoding, or the first shapes of a spec.
ENGINE_LANES: dict[str, SpecConfig | None] = {
    "plain": None,
    "eagle-chain": SPECS["eagle"].configs[0],
    "eagle-tree": SPECS["eagle-tree"].configs[0],
    "mtp-chain": SPECS["mtp"].configs[0],
    "mtp-tree": SPECS["mtp"].configs[1],
}


def parse_engine_lanes(text: str) -> list[str]:
    """``"plain,eagle-chain"`` -> the names, each a key of ``ENGINE_LANES``; ValueError naming
    the flag and the unknown names otherwise."""
    lanes = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in lanes if name not in ENGINE_LANES]
    if unknown or not lanes:
        raise ValueError(f"--lanes: unknown {', '.join(unknown) or 'none given'}; one or more "
                         f"of {', '.join(ENGINE_LANES)}")
    return lanes


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lane:
        """The inverse of ``dataclasses.asdict`` (how a lane reaches a bench worker)."""
        spec = data["spec"]
        return cls(data["label"], data["backend"], None if spec is None else SpecConfig(**spec),
                   data["graphs"])


@dataclass(frozen=True)
class Workload:
    """What every lane of a bench run decodes: greedy, ``max_new_tokens`` per request, each
    batch size in ``ceil(min_requests / b)`` groups, each group ``repeats`` times."""

    model: str
    batch_sizes: tuple[int, ...]
    max_new_tokens: int
    min_requests: int = 1
    repeats: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        """ValueError naming the flag of a value no bench can run."""
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"--batch-sizes: expected integers >= 1, got {list(self.batch_sizes)}")
        for flag, value in (("--max-new-tokens", self.max_new_tokens),
                            ("--min-requests", self.min_requests), ("--repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{flag}: must be >= 1, got {value}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """The inverse of ``dataclasses.asdict``."""
        return cls(**{**data, "batch_sizes": tuple(data["batch_sizes"])})


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


CHAINS = "chains"  # the bench's own --spec: the lanes of ``chain_lanes``, each in its own process
# ``--spec chains``: plain decoding and the chain configurations of these specs, the
# algorithms another engine is most likely to run too; EAGLE-3 right after EAGLE, so the two
# heads' tau sit together.
CHAIN_SPECS = ("eagle", "eagle3", "ngram", "draft-model")
# The EAGLE head whose drafts vLLM computes exactly as the reference engine does (vLLM's
# EAGLE-1 layout, which refengine also runs), so both engines' EAGLE lanes draft alike.
SHARED_EAGLE_HEAD = "tiny-code-eagle-vllm"


def chain_lanes(backends: list[str], claims: Callable[[str, str], bool],
                eagle_head: str = SHARED_EAGLE_HEAD) -> list[Lane]:
    """``--spec chains``: plain decoding, then each chain configuration of ``CHAIN_SPECS`` (the
    EAGLE ones drafting with ``eagle_head``), each on every backend that ``claims(backend,
    algorithm)``; a configuration's lanes follow one another, backend by backend, so a drifting
    machine affects the backends compared alike."""
    configs: list[SpecConfig | None] = [None]
    for name in CHAIN_SPECS:
        for c in SPECS[name].configs:
            assert c is not None and c.topk == 1
            configs.append(replace(c, draft_model=eagle_head) if c.algorithm == "eagle" else c)
    return [Lane(config_id(c), b, c) for c in configs for b in backends
            if claims(b, "none" if c is None else c.algorithm)]


# Algorithms a spec lane is judged beside EAGLE at the same shape (equal N), and that head.
EAGLE_TWINNED = ("eagle3", "frozen_kv_mtp", "ngram")
TWIN_EAGLE_HEAD = "tiny-code-eagle"


def twin_of(config: SpecConfig) -> SpecConfig | None:
    """What a configuration is judged beside: overlap scheduling beside its sequential twin,
    EAGLE-3, Frozen-KV MTP and n-gram lookup beside EAGLE at the same shape (equal N); None for
    the rest."""
    if config.overlap:
        return replace(config, overlap=False)
    if config.algorithm in EAGLE_TWINNED:
        return replace(config, algorithm="eagle", draft_model=TWIN_EAGLE_HEAD)
    return None


def with_draft_model(lanes: list[Lane], draft_model: str, spec: str) -> list[Lane]:
    """``--draft-model`` over the lanes of ``lanes_for(spec)``: the lanes of the spec's own
    algorithm (V1 twins of V2 lanes included) draft with it, EAGLE twins of another algorithm
    keep ``TWIN_EAGLE_HEAD`` (an EAGLE-3 head or an MTP assistant is no EAGLE-1 head); under a
    spec whose algorithm loads no model (n-gram lookup) the flag can only name its twins'
    head, and does."""
    own = SPECS[spec].algorithm
    reads_model = any(c is not None and c.needs_draft_model for c in SPECS[spec].configs)
    return [replace(ln, spec=replace(ln.spec, draft_model=draft_model))
            if ln.spec is not None and (ln.spec.algorithm == own or not reads_model) else ln
            for ln in lanes]
