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
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from conformance.contract import SpecConfig
from conformance.plan.specs import config_id
from conformance.report.results import CheckRow, ConfigRecord, JsonValue, Scalar


def config_record(config: SpecConfig | None) -> ConfigRecord:
    """A configuration as the results file states it: its id and every parameter."""
    if config is None:
        return ConfigRecord(config_id(None), {"algorithm": "none"})
    return ConfigRecord(config_id(config), asdict(config))


def accept_histogram(accept_lens: Iterable[Iterable[int]]) -> dict[str, int]:
    """Verify steps per accept length (tokens per verify, bonus included); JSON keys."""
    counts = Counter(n for lens in accept_lens for n in lens)
    return {str(n): counts[n] for n in sorted(counts)}


@dataclass
class ConfigRun:
    """One configuration as run, with what its checks measured (None: no check measured it)."""

    id: str
    parameters: dict[str, Scalar]
    tau: float | None = None             # lossless tier: the mean of its checks' τ
    tau_checks: int = 0
    golden_tau: float | None = None      # golden tier: the backend's mean τ on golden prompts
    golden_reference_tau: float | None = None  # the golden trace's, same requests
    accept_hist: dict[str, int] = field(default_factory=dict)
    golden_accept_hist: dict[str, int] = field(default_factory=dict)

    @property
    def num_steps(self) -> int | None:
        """Drafts per verify step, where the configuration states it."""
        steps = self.parameters.get("num_steps")
        return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


@dataclass(frozen=True)
class NearTie:
    check: str
    near_tie: str  # where the backend diverged, and the reference's top-2 margin there


def config_of(nodeid: str, ids: list[str]) -> str | None:
    """The configuration a check ran, from its parametrize id; longest id first, so
    ``chain-s3-n4-v2`` is never taken for ``chain-s3-n4``."""
    param = nodeid.partition("[")[2].rstrip("]")
    for cid in sorted(ids, key=len, reverse=True):
        if param == cid or param.startswith(cid + "-"):
            return cid
    return None


def _number(value: JsonValue) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _add(hist: dict[str, int], more: JsonValue) -> None:
    if isinstance(more, dict):
        for length, count in more.items():
            hist[length] = hist.get(length, 0) + int(_number(count) or 0)


def config_runs(configurations: Sequence[ConfigRecord], checks: Sequence[CheckRow]
                ) -> list[ConfigRun]:
    runs = {c.id: ConfigRun(c.id, dict(c.parameters)) for c in configurations}
    taus: dict[str, list[float]] = {cid: [] for cid in runs}
    for check in checks:
        cid = config_of(check.nodeid, list(runs))
        if cid is None:
            continue
        run, figures = runs[cid], check.figures
        tau = _number(figures.get("tau"))
        if tau is not None:
            taus[cid].append(tau)
        if "mean_tau" in figures:
            run.golden_tau = _number(figures["mean_tau"])
            run.golden_reference_tau = _number(figures.get("golden_mean_tau"))
        _add(run.accept_hist, figures.get("accept_hist"))
        _add(run.golden_accept_hist, figures.get("golden_accept_hist"))
    for cid, values in taus.items():
        if values:
            runs[cid].tau = round(sum(values) / len(values), 3)
            runs[cid].tau_checks = len(values)
    return list(runs.values())


def near_ties(checks: Sequence[CheckRow]) -> list[NearTie]:
    """Every near-tie a check listed: where the backend diverged from the reference at a
    position whose top-2 margin is below the declared precision's bound."""
    found = []
    for check in checks:
        ties = check.figures.get("near_ties")
        if isinstance(ties, list):
            found += [NearTie(check.nodeid, str(tie)) for tie in ties]
    return found
