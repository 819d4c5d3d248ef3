"""The spec configurations the suite knows, by their ``--spec`` names."""

from __future__ import annotations

from dataclasses import dataclass

from refengine.config import SpecConfig


@dataclass(frozen=True)
class SpecChoice:
    name: str
    algorithm: str              # the capability a backend must claim ("none", "eagle", ...)
    configs: tuple[SpecConfig | None, ...]
    needs_tree: bool = False


SPECS: dict[str, SpecChoice] = {
    "none": SpecChoice("none", "none", (None,)),
}
PLANNED = ("eagle", "eagle-tree", "eagle-v2", "mtp")  # named in DESIGN §2.2, not built yet


def resolve_specs(name: str) -> list[SpecChoice]:
    """``all`` expands to every implemented spec; unknown or unbuilt names raise ValueError."""
    if name == "all":
        return list(SPECS.values())
    if name in SPECS:
        return [SPECS[name]]
    if name in PLANNED:
        raise ValueError(f"--spec {name}: not implemented in this version (available: "
                         f"{', '.join([*SPECS, 'all'])})")
    raise ValueError(f"--spec: unknown spec {name!r} (available: {', '.join([*SPECS, 'all'])})")
