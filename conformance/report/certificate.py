"""The certificate: what a run's results (``conformance.report.results``) certify, built by
``build_certificate`` under the verdict rules of ``conformance.report.verdict``, and rendered as
report.json (``Certificate.to_json``), report.md (``conformance.report.markdown``) and on the
console (``conformance.report.console``).

Every check that did not run is listed with its reason; every failure with the command that
replays it (``conformance.report.failures``). A run stopped by Ctrl-C gives a certificate whose
status is "incomplete": it covers the checks that finished, and only those.

The certificate also says what was certified (``conformance.report.certified``): every
configuration with its parameters and τ, the precision the backend declares, the near-ties, the
accept-length histograms that become ``acceptance.png`` (``conformance.report.acceptance_chart``)
when the golden tier ran, and how much of the suite ran (``conformance.report.coverage``).
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

from conformance.contract import Capabilities
from conformance.report.acceptance_chart import AcceptPanel, plots_unavailable
from conformance.report.certified import ConfigRun, NearTie, config_runs, near_ties
from conformance.report.coverage import RAN, Coverage, coverage
from conformance.report.failures import Failure, Rerun
from conformance.report.results import (
    DEFAULT_MODEL,
    BackendIdentity,
    CheckRow,
    KnownReport,
    Replay,
    RunResults,
    Scalar,
)
from conformance.report.results_json import fields_json
from conformance.report.verdict import (
    INCOMPLETE,
    KNOWN_FAILURE,
    NOT_CLAIMED,
    OUTCOMES,
    backend_rows,
    is_self_check,
    run_verdict,
    tier_status,
)


@dataclass
class TierSummary:
    tier: str
    counts: dict[str, int]
    status: str
    seconds: float
    failures: list[Failure] = field(default_factory=list)
    not_run: dict[str, int] = field(default_factory=dict)  # "outcome: reason" -> checks


@dataclass(frozen=True)
class SelfCheck:
    """A check of the suite itself (``conformance.report.verdict``), outside the tiers."""

    check: str
    outcome: str
    message: str


@dataclass
class Certificate:
    backend: BackendIdentity
    capabilities: Capabilities
    spec: str
    profile: str
    tiers: list[TierSummary]
    status: str                # "passed" | "failed" | "incomplete" (interrupted)
    vacuous: str | None
    environment: dict[str, Scalar]  # where it ran (device, CUDA, driver, dtype, TF32 too)
    created: str
    checks: tuple[CheckRow, ...]  # every row, self-checks included
    matrix: dict[str, dict[str, str]]  # capability -> tier -> status of checks needing it
    interrupted: bool = False
    graphs: str | None = None  # the backend's graph executor the run asked for (None: eager)
    device: str = "cpu"  # where the run asked the backend to run (--device)
    # capability -> why the backend does not claim it (Backend.unclaimed_reasons, optional)
    unclaimed_reasons: dict[str, str] = field(default_factory=dict)
    precision: str = "float32"  # what the backend declares (Capabilities.precision)
    configurations: list[ConfigRun] = field(default_factory=list)
    near_ties: list[NearTie] = field(default_factory=list)
    case_timeout: float | None = None  # seconds per phase of a check; 0: no limit
    specgate_version: str = ""  # the specgate that ran the suite
    shard: str | None = None    # "I/N" for one shard's certificate; "merged from N" after merge
    selection: str | None = None  # --only / -k as the run was given them (None: every check)
    known_failures: KnownReport | None = None  # with --known-failures
    plot_skipped: str | None = None  # why acceptance.png was not drawn though there were panels
    self_checks: list[SelfCheck] = field(default_factory=list)  # not in the tiers' counts
    threads: list[int] = field(default_factory=list)  # torch threads the checks ran with
    coverage: Coverage = field(default_factory=lambda: Coverage(0, 0, 0, 0))
    required: str | None = None  # certify --require: the class a run must meet
    model: str = DEFAULT_MODEL        # --model: what every check opened the backend on
    draft_model: str | None = None    # --draft-model, where the run named one
    unmet: str | None = None     # why ``required`` is not met (the run then fails)

    def __post_init__(self) -> None:
        if self.plot_skipped is None and self.acceptance_panels:
            self.plot_skipped = plots_unavailable()

    @property
    def acceptance_panels(self) -> list[AcceptPanel]:
        return [AcceptPanel(c.id, c.accept_hist, c.golden_accept_hist, c.num_steps)
                for c in self.configurations if c.accept_hist or c.golden_accept_hist]

    @property
    def failures(self) -> list[Failure]:
        return [f for t in self.tiers for f in t.failures]

    @property
    def total_checks(self) -> int:
        return sum(sum(t.counts.values()) for t in self.tiers)

    def to_json(self) -> str:
        """report.json."""
        return json.dumps(fields_json(self), indent=1)


def _torch_version() -> str:
    """The installed torch's version, read from its metadata: building a certificate imports no
    torch, so ``specgate report merge`` runs where torch is not installed."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _environment(threads: tuple[int, ...], run: dict[str, Scalar]) -> dict[str, Scalar]:
    """Where the checks ran; ``threads``: the torch intra-op thread counts they ran with (in
    the processes that ran them, which under ``-n`` are not this one); ``run``: the run's
    device record (``conformance.report.environment``)."""
    return {"python": platform.python_version(), "torch": _torch_version(),
            "platform": platform.platform(),
            "threads per check": ", ".join(map(str, threads)) or "unknown", **run}


def _not_run(rows: list[CheckRow]) -> dict[str, int]:
    """"outcome: reason" -> how many checks, for the checks that did not run."""
    def why(row: CheckRow) -> str:
        message = row.message.removeprefix("Skipped: ")
        return message.removeprefix(f"{row.outcome}: ")  # "not claimed: x" says it already
    reasons = Counter(f"{r.outcome}: {why(r)}" for r in rows
                      if r.outcome in ("skipped", NOT_CLAIMED))
    return dict(sorted(reasons.items()))


def _tier_summary(tier: str, rows: list[CheckRow], collected: int) -> TierSummary:
    """One tier's counts, status, time, failures and checks that did not run; ``collected``:
    the checks an interrupted run was to run in it (0 otherwise)."""
    counts = Counter(r.outcome for r in rows)
    unfinished = max(0, collected - len(rows))
    not_run = _not_run(rows)
    if unfinished:
        not_run[f"{INCOMPLETE}: the run was interrupted before they finished"] = unfinished
    return TierSummary(
        tier, {o: counts[o] for o in OUTCOMES}, INCOMPLETE if unfinished
        else tier_status(r.outcome for r in rows),
        round(sum(r.duration for r in rows), 2),
        [Failure(r.nodeid, r.message, Replay.of(r)) for r in rows if r.outcome == "failed"],
        not_run)


def _matrix(tiers: dict[str, list[CheckRow]]) -> dict[str, dict[str, str]]:
    """Capability -> tier -> the status of the tier's checks that need it."""
    matrix: dict[str, dict[str, str]] = {}
    for tier, rows in sorted(tiers.items()):
        for cap in sorted({c for r in rows for c in r.requires.split(",") if c}):
            needing = (r.outcome for r in rows if cap in r.requires)
            matrix.setdefault(cap, {})[tier] = tier_status(needing)
    return matrix


def build_certificate(results: RunResults) -> Certificate:
    checks = backend_rows(results.checks)
    tiers: dict[str, list[CheckRow]] = {}
    for check in checks:
        tiers.setdefault(check.tier, []).append(check)
    # an interrupted run: the checks each tier was to run, so a tier cut short says so
    collected = results.collected if results.interrupted else {}
    for tier in collected:
        tiers.setdefault(tier, [])
    summaries = [_tier_summary(tier, rows, collected.get(tier, 0))
                 for tier, rows in sorted(tiers.items())]
    covered = coverage(checks, results.capabilities)
    unmet = covered.unmet(results.require) if results.require else None
    verdict = run_verdict(results, [s.status for s in summaries], unmet)
    return Certificate(
        backend=results.backend, capabilities=results.capabilities, spec=results.spec,
        profile=results.profile, tiers=summaries, status=verdict.status,
        vacuous=verdict.vacuous, environment=_environment(results.threads, results.environment),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        checks=results.checks, matrix=_matrix(tiers), interrupted=results.interrupted,
        unclaimed_reasons=dict(results.unclaimed_reasons), graphs=results.graphs,
        device=results.device, precision=results.precision,
        configurations=config_runs(results.configurations, checks),
        near_ties=near_ties(checks), case_timeout=results.case_timeout,
        specgate_version=results.specgate_version, shard=results.shard,
        selection=results.selection, known_failures=results.known_failures,
        self_checks=[SelfCheck(r.nodeid, r.outcome, r.message)
                     for r in results.checks if is_self_check(r)],
        threads=list(results.threads), coverage=covered, required=results.require,
        unmet=unmet, model=results.model, draft_model=results.draft_model)


def headline(cert: Certificate) -> str:
    if cert.interrupted:
        return "INCOMPLETE (interrupted)"
    known = sum(t.counts.get(KNOWN_FAILURE, 0) for t in cert.tiers)
    notes = [f"{known} known failure(s)"] if known else []
    if cert.known_failures and cert.known_failures.stale:
        notes.append(f"{len(cert.known_failures.stale)} stale")
    return cert.status.upper() + (f" ({', '.join(notes)})" if notes else "")


def rerun_of(cert: Certificate) -> Rerun:
    """What a rerun of one of this certificate's checks must say to run it as it ran."""
    return Rerun(cert.backend.resolved_from, cert.spec, cert.profile, cert.model,
                 cert.draft_model, cert.graphs, cert.device)


def full_headline(cert: Certificate) -> str:
    """The verdict with what it covered: ``PASSED — 15 of 75 checks ran; 60 not claimed (...);
    coverage: outputs``."""
    if cert.interrupted:
        return headline(cert)
    part = (" (of the checks selected)" if cert.selection else
            " (of this shard)" if cert.shard and not cert.shard.startswith("merged") else "")
    return (f"{headline(cert)} — {cert.coverage.describe()}; "
            f"coverage: {cert.coverage.met or 'none'}{part}")


def tier_share(t: TierSummary) -> str:
    """``14 of 17``: the tier's checks that ran (passed, failed or known) of those collected."""
    ran = sum(t.counts.get(o, 0) for o in RAN)
    return f"{ran} of {sum(t.counts.values())}"
