"""The spec configurations the suite knows, by their ``--spec`` names."""

from __future__ import annotations

from dataclasses import dataclass, replace

from refengine.config import SpecConfig


@dataclass(frozen=True)
class SpecChoice:
    name: str
    algorithm: str              # the capability a backend must claim ("none", "eagle", ...)
    configs: tuple[SpecConfig | None, ...]
    needs_tree: bool = False
    needs_overlap: bool = False

    def with_draft_model(self, draft_model: str) -> SpecChoice:
        return replace(self, configs=tuple(
            c if c is None else replace(c, draft_model=draft_model) for c in self.configs))


def _eagle(steps: int, topk: int, tokens: int, overlap: bool = False) -> SpecConfig:
    return SpecConfig(algorithm="eagle", draft_model="tiny-code-eagle", num_steps=steps,
                      topk=topk, num_draft_tokens=tokens, overlap=overlap)


def _eagle3(steps: int, topk: int, tokens: int, overlap: bool = False) -> SpecConfig:
    return SpecConfig(algorithm="eagle3", draft_model="tiny-code-eagle3", num_steps=steps,
                      topk=topk, num_draft_tokens=tokens, overlap=overlap)


def _mtp(steps: int, topk: int, tokens: int, overlap: bool = False) -> SpecConfig:
    return SpecConfig(algorithm="frozen_kv_mtp", draft_model="tiny-code-mtp", num_steps=steps,
                      topk=topk, num_draft_tokens=tokens, overlap=overlap)


def _draft_model(steps: int) -> SpecConfig:
    return SpecConfig(algorithm="draft_model", draft_model="tiny-code-draft", num_steps=steps,
                      topk=1, num_draft_tokens=steps + 1)


def _ngram(steps: int) -> SpecConfig:
    return SpecConfig(algorithm="ngram", num_steps=steps, topk=1, num_draft_tokens=steps + 1)


SPECS: dict[str, SpecChoice] = {
    "none": SpecChoice("none", "none", (None,)),
    # The configurations the issue pins: chain (S=3,N=4), (S=5,N=6); tree (S=3,k=4,N=8),
    # (S=5,k=8,N=16). The first of each is the one single-config checks use.
    "eagle": SpecChoice("eagle", "eagle", (_eagle(3, 1, 4), _eagle(5, 1, 6))),
    "eagle-tree": SpecChoice("eagle-tree", "eagle", (_eagle(3, 4, 8), _eagle(5, 8, 16)),
                             needs_tree=True),
    # EAGLE V2: overlap scheduling, a chain and a tree (its trees need the tree capability).
    "eagle-v2": SpecChoice("eagle-v2", "eagle", (_eagle(3, 1, 4, overlap=True),
                                                 _eagle(3, 4, 8, overlap=True)),
                           needs_tree=True, needs_overlap=True),
    # EAGLE-3 (a head over three of the target's layers, with a vocabulary of its own) at
    # EAGLE's chain and tree shapes, so the two compare at equal N. Its overlap scheduling
    # (V2) is EAGLE's code path, covered by the engine's tests rather than a third spec.
    "eagle3": SpecChoice("eagle3", "eagle3", (_eagle3(3, 1, 4), _eagle3(5, 1, 6))),
    "eagle3-tree": SpecChoice("eagle3-tree", "eagle3", (_eagle3(3, 4, 8), _eagle3(5, 8, 16)),
                              needs_tree=True),
    # Frozen-KV MTP (an assistant that reads the target's KV and keeps none): a chain and a
    # tree at EAGLE's first shapes, so the two compare at equal N.
    "mtp": SpecChoice("mtp", "frozen_kv_mtp", (_mtp(3, 1, 4), _mtp(3, 4, 8)), needs_tree=True),
    # A standalone draft model (its own small Llama and KV) drafting a chain, at EAGLE's
    # chain lengths N=4 and N=6.
    "draft-model": SpecChoice("draft-model", "draft_model", (_draft_model(3), _draft_model(5))),
    # N-gram lookup over the request's own context (no draft model), at the same chains.
    "ngram": SpecChoice("ngram", "ngram", (_ngram(3), _ngram(5))),
}


PREFIXES = {"eagle3": "eagle3-", "frozen_kv_mtp": "mtp-"}  # ids of EAGLE's shapes, other drafts


def config_id(config: SpecConfig | None) -> str:
    """A short stable name for a configuration: ``plain``, ``chain-s3-n4``, ``tree-s3-k4-n8``,
    with ``-v2`` for overlap scheduling; ``draft-n4`` for a draft model's chain of N=4,
    ``ngram-n4`` for an n-gram chain of N=4; EAGLE-3 and Frozen-KV MTP shapes as EAGLE's after
    ``eagle3-`` and ``mtp-``."""
    if config is None:
        return "plain"
    if config.algorithm == "draft_model":
        return f"draft-n{config.num_draft_tokens}"
    v2 = "-v2" if config.overlap else ""
    if config.algorithm == "ngram":
        return f"ngram-n{config.num_draft_tokens}{v2}"
    if config.algorithm in PREFIXES:
        return PREFIXES[config.algorithm] + config_id(replace(config, algorithm="eagle"))
    if config.topk == 1:
        return f"chain-s{config.num_steps}-n{config.num_draft_tokens}{v2}"
    return f"tree-s{config.num_steps}-k{config.topk}-n{config.num_draft_tokens}{v2}"


def resolve_specs(name: str) -> list[SpecChoice]:
    """``all`` expands to every spec; unknown names raise ValueError."""
    if name == "all":
        return list(SPECS.values())
    if name in SPECS:
        return [SPECS[name]]
    raise ValueError(f"--spec: unknown spec {name!r} (available: {', '.join([*SPECS, 'all'])})")
