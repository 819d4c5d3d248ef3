"""What a certificate says was certified: each configuration's parameters, its τ, its
accept-length histograms, and the near-ties the lossless tier listed.

The plugin writes ``config_record`` for every configuration it ran. The figures come from the
checks' properties: the lossless tier's ``tau`` per check, the golden tier's ``mean_tau`` and
``golden_mean_tau`` and its histograms ``accept_hist`` (the backend, on the golden prompts) and
``golden_accept_hist`` (the golden trace, the same requests), and the lossless tier's
``near_ties``. A check belongs to the configuration its parametrize id starts with
(``conformance.plan.specs.config_id``, first in every id of a spec-parametrised check).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from conformance.contract import SpecConfig
from conformance.plan.specs import config_id


def config_record(config: SpecConfig | None) -> dict[str, object]:
    """A configuration as the results file states it: its id and every parameter."""
    if config is None:
        return {"id": config_id(None), "algorithm": "none"}
    return {"id": config_id(config), **asdict(config)}


def accept_histogram(accept_lens: Iterable[Iterable[int]]) -> dict[str, int]:
    """Verify steps per accept length (tokens per verify, bonus included); JSON keys."""
    counts = Counter(n for lens in accept_lens for n in lens)
    return {str(n): counts[n] for n in sorted(counts)}


@dataclass
class ConfigRun:
    """One configuration as run, with what its checks measured (None: no check measured it)."""

    id: str
    parameters: dict[str, object]
    tau: float | None = None             # lossless tier: the mean of its checks' τ
    tau_checks: int = 0
    golden_tau: float | None = None      # golden tier: the backend's mean τ on golden prompts
    golden_reference_tau: float | None = None  # the golden trace's, same requests
    accept_hist: dict[str, int] = field(default_factory=dict)
    golden_accept_hist: dict[str, int] = field(default_factory=dict)


def config_of(nodeid: str, ids: list[str]) -> str | None:
    """The configuration a check ran, from its parametrize id; longest id first, so
    ``chain-s3-n4-v2`` is never taken for ``chain-s3-n4``."""
    param = nodeid.partition("[")[2].rstrip("]")
    for cid in sorted(ids, key=len, reverse=True):
        if param == cid or param.startswith(cid + "-"):
            return cid
    return None


def _add(hist: dict[str, int], more: object) -> None:
    if isinstance(more, dict):
        for length, count in more.items():
            hist[str(length)] = hist.get(str(length), 0) + int(count)


def config_runs(configurations: list[dict[str, object]],
                checks: list[dict[str, object]]) -> list[ConfigRun]:
    runs = {str(c["id"]): ConfigRun(str(c["id"]), {k: v for k, v in c.items() if k != "id"})
            for c in configurations}
    taus: dict[str, list[float]] = {cid: [] for cid in runs}
    for check in checks:
        cid = config_of(str(check["nodeid"]), list(runs))
        figures = check.get("figures") or {}
        if cid is None or not isinstance(figures, dict):
            continue
        run = runs[cid]
        if "tau" in figures:
            taus[cid].append(float(figures["tau"]))
        if "mean_tau" in figures:
            run.golden_tau = figures["mean_tau"]  # type: ignore[assignment]
            run.golden_reference_tau = figures.get("golden_mean_tau")  # type: ignore[assignment]
        _add(run.accept_hist, figures.get("accept_hist"))
        _add(run.golden_accept_hist, figures.get("golden_accept_hist"))
    for cid, values in taus.items():
        if values:
            runs[cid].tau = round(sum(values) / len(values), 3)
            runs[cid].tau_checks = len(values)
    return list(runs.values())


def near_ties(checks: list[dict[str, object]]) -> list[dict[str, str]]:
    """Every near-tie a check listed: where the backend diverged from the reference at a
    position whose top-2 margin is below the declared precision's bound."""
    found = []
    for check in checks:
        figures = check.get("figures") or {}
        for tie in (figures.get("near_ties") or []) if isinstance(figures, dict) else []:
            found.append({"check": str(check["nodeid"]), "near_tie": str(tie)})
    return found
