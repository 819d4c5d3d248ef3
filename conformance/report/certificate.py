"""The certificate: report.md and report.json from the plugin's per-check results.

A tier's status is, in order: "failed" if any check failed; "not claimed" if every check was
gated off by an undeclared capability; "skipped" if nothing ran for another reason; else
"passed"; a tier whose checks that ran are all known failures (``--known-failures``) is "known
failure". Nothing counts as passed unless at least one check in it passed. Every check that did
not run is listed in report.md with its reason; every failure with the command that replays it
(``conformance.report.failures``). A run stopped by Ctrl-C gives a certificate whose status is
"incomplete": it covers the checks that finished, and only those.

The certificate also says what was certified (``conformance.report.certified``): every configuration
with its parameters and τ, the precision the backend declares, the near-ties, and beside
report.md ``acceptance.png`` (``conformance.report.acceptance_chart``) when the golden tier ran
(or why it was skipped: matplotlib is an optional extra), and the checks' figures as a table per
tier (``conformance.report.figures``).
"""

from __future__ import annotations

import json
import platform
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from conformance.report.acceptance_chart import (
    AcceptPanel,
    per_position_rates,
    plots_unavailable,
    save_acceptance,
    shares,
)
from conformance.report.certified import ConfigRun, config_runs, near_ties
from conformance.report.coverage import CLASSES, RAN, Coverage, coverage
from conformance.report.failures import (
    DEFAULT_MODEL,
    Rerun,
    failure_lines,
    known_lines,
    replay_fields,
)
from conformance.report.figures import figures_lines
from conformance.report.verdict import KNOWN_FAILURE, backend_rows, is_self_check

OUTCOMES = ("passed", "failed", KNOWN_FAILURE, "not claimed", "skipped")
INCOMPLETE = "incomplete"  # a tier (or run) an interrupt cut short


@dataclass
class TierSummary:
    tier: str
    counts: dict[str, int]
    status: str
    seconds: float
    # check, message[, repro, repro_reproduces: "yes" | "no" | "not replayed"]
    failures: list[dict[str, str]] = field(default_factory=list)
    not_run: dict[str, int] = field(default_factory=dict)  # "outcome: reason" -> checks


@dataclass
class Certificate:
    backend: dict[str, object]  # name, version, resolved_from, contract_version (declared)
    capabilities: dict[str, object]
    spec: str
    profile: str
    tiers: list[TierSummary]
    status: str                # "passed" | "failed" | "incomplete" (interrupted)
    vacuous: str | None
    environment: dict[str, object]  # where it ran (device, CUDA, driver, dtype, TF32 too)
    created: str
    checks: list[dict[str, object]]
    matrix: dict[str, dict[str, str]]  # capability -> tier -> status of checks needing it
    interrupted: bool = False
    graphs: str | None = None  # the backend's graph executor the run asked for (None: eager)
    device: str = "cpu"  # where the run asked the backend to run (--device)
    # capability -> why the backend does not claim it (Backend.unclaimed_reasons, optional)
    unclaimed_reasons: dict[str, str] = field(default_factory=dict)
    precision: str = "float32"  # what the backend declares (Capabilities.precision)
    configurations: list[ConfigRun] = field(default_factory=list)
    near_ties: list[dict[str, str]] = field(default_factory=list)
    case_timeout: float | None = None  # seconds per phase of a check; 0: no limit
    specgate_version: str = ""  # the specgate that ran the suite
    shard: str | None = None    # "I/N" for one shard's certificate; "merged from N" after merge
    selection: str | None = None  # --only / -k as the run was given them (None: every check)
    known_failures: dict[str, object] | None = None  # KnownReport, with --known-failures
    plot_skipped: str | None = None  # why acceptance.png was not drawn though there were panels
    # The suite checking itself (conformance.report.verdict): check, outcome, message; not in
    # the tiers' counts
    self_checks: list[dict[str, str]] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)  # torch threads the checks ran with
    # how much ran, what was not claimed, the coverage class met (conformance.report.coverage)
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
        return [AcceptPanel(c.id, c.accept_hist, c.golden_accept_hist,
                            c.parameters.get("num_steps"))  # type: ignore[arg-type]
                for c in self.configurations if c.accept_hist or c.golden_accept_hist]

    @property
    def failures(self) -> list[dict[str, str]]:
        return [f for t in self.tiers for f in t.failures]

    @property
    def total_checks(self) -> int:
        return sum(sum(t.counts.values()) for t in self.tiers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _status(counts: Counter[str]) -> str:
    if counts["failed"]:
        return "failed"
    if counts["passed"]:
        return "passed"
    if counts[KNOWN_FAILURE]:
        return KNOWN_FAILURE
    if counts["not claimed"]:
        return "not claimed"
    return "skipped"


def _torch_version() -> str:
    """The installed torch's version, read from its metadata: building a certificate imports no
    torch, so ``specgate report merge`` runs where torch is not installed."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _environment(threads: list[int], run: dict[str, object]) -> dict[str, object]:
    """Where the checks ran; ``threads``: the torch intra-op thread counts they ran with (in
    the processes that ran them, which under ``-n`` are not this one); ``run``: the run's
    device record (``conformance.report.environment``)."""
    return {"python": platform.python_version(), "torch": _torch_version(),
            "platform": platform.platform(),
            "threads per check": ", ".join(map(str, threads)) or "unknown", **run}


def _not_run(rows: list[dict[str, object]]) -> dict[str, int]:
    """"outcome: reason" -> how many checks, for the checks that did not run."""
    def why(row: dict[str, object]) -> str:
        message = str(row["message"]).removeprefix("Skipped: ")
        return message.removeprefix(f"{row['outcome']}: ")  # "not claimed: x" says it already
    reasons = Counter(f"{r['outcome']}: {why(r)}"
                      for r in rows if r["outcome"] in ("skipped", "not claimed"))
    return dict(sorted(reasons.items()))


def build_certificate(results: dict[str, object]) -> Certificate:
    every_row: list[dict[str, object]] = list(results["checks"])  # type: ignore[arg-type]
    checks = backend_rows(every_row)
    self_checks = [{"check": str(r["nodeid"]), "outcome": str(r["outcome"]),
                    "message": str(r["message"])} for r in every_row if is_self_check(r)]
    tiers: dict[str, list[dict[str, object]]] = {}
    for check in checks:
        tiers.setdefault(str(check["tier"]), []).append(check)
    interrupted = bool(results.get("interrupted"))
    # an interrupted run: the checks each tier was to run, so a tier cut short says so
    collected: dict[str, int] = dict(results.get("collected", {})) if interrupted else {}  # type: ignore[call-overload]
    for tier in collected:
        tiers.setdefault(tier, [])
    summaries = []
    for tier, rows in sorted(tiers.items()):
        counts = Counter(str(r["outcome"]) for r in rows)
        unfinished = max(0, int(collected.get(tier, 0)) - len(rows))
        not_run = _not_run(rows)
        if unfinished:
            not_run[f"{INCOMPLETE}: the run was interrupted before they finished"] = unfinished
        summaries.append(TierSummary(
            tier, {o: counts[o] for o in OUTCOMES}, INCOMPLETE if unfinished else _status(counts),
            round(sum(float(r["duration"]) for r in rows), 2),
            [{"check": str(r["nodeid"]), "message": str(r["message"]), **replay_fields(r)}
             for r in rows if r["outcome"] == "failed"], not_run))
    matrix: dict[str, dict[str, str]] = {}
    for tier, rows in sorted(tiers.items()):
        for cap in sorted({c for r in rows for c in str(r["requires"]).split(",") if c}):
            needing = Counter(str(r["outcome"]) for r in rows if cap in str(r["requires"]))
            matrix.setdefault(cap, {})[tier] = _status(needing)
    known = results.get("known_failures")
    vacuous = results.get("vacuous")
    if not vacuous and checks and known and not any(c["outcome"] == "passed" for c in checks):
        vacuous = "no check passed (every failure is a known failure)"
    failed = any(s.status == "failed" for s in summaries) or bool(vacuous) or bool(
        known and known["strict"] and known["stale"]) or any(  # type: ignore[index]
        c["outcome"] == "failed" for c in self_checks)
    covered = coverage(checks, dict(results["capabilities"]))  # type: ignore[call-overload]
    required = results.get("require")
    unmet = covered.unmet(str(required)) if required else None
    failed = failed or bool(unmet)
    return Certificate(
        backend=dict(results["backend"]),  # type: ignore[arg-type]
        capabilities=dict(results["capabilities"]),  # type: ignore[arg-type]
        spec=str(results["spec"]), profile=str(results["profile"]), tiers=summaries,
        status=(INCOMPLETE if interrupted else
                "failed" if failed or not summaries else "passed"),
        vacuous=vacuous or (None if summaries or interrupted else "zero checks collected"),
        environment=_environment(list(results.get("threads", [])),  # type: ignore[call-overload]
                                 dict(results.get("environment", {}))),  # type: ignore[call-overload]
        created=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ"),
        checks=every_row, matrix=matrix, interrupted=interrupted,
        unclaimed_reasons=dict(results.get("unclaimed_reasons", {})),  # type: ignore[call-overload]
        graphs=results.get("graphs"),  # type: ignore[arg-type]
        device=str(results.get("device", "cpu")),
        precision=str(results.get("precision", "float32")),
        configurations=config_runs(list(results.get("configurations", [])),  # type: ignore[call-overload]
                                   checks),
        near_ties=near_ties(checks),
        case_timeout=results.get("case_timeout"),  # type: ignore[arg-type]
        specgate_version=str(results.get("specgate_version", "")),
        shard=results.get("shard"),  # type: ignore[arg-type]
        selection=results.get("selection"),  # type: ignore[arg-type]
        known_failures=known,  # type: ignore[arg-type]
        self_checks=self_checks, threads=list(results.get("threads", [])),  # type: ignore[call-overload]
        coverage=covered, required=required, unmet=unmet,  # type: ignore[arg-type]
        model=str(results.get("model", DEFAULT_MODEL)),
        draft_model=results.get("draft_model"))  # type: ignore[arg-type]


def headline(cert: Certificate) -> str:
    if cert.interrupted:
        return "INCOMPLETE (interrupted)"
    known = sum(t.counts.get(KNOWN_FAILURE, 0) for t in cert.tiers)
    notes = [f"{known} known failure(s)"] if known else []
    if cert.known_failures and cert.known_failures["stale"]:
        notes.append(f"{len(cert.known_failures['stale'])} stale")  # type: ignore[arg-type]
    return cert.status.upper() + (f" ({', '.join(notes)})" if notes else "")


def rerun_of(cert: Certificate) -> Rerun:
    """What a rerun of one of this certificate's checks must say to run it as it ran."""
    return Rerun(str(cert.backend["resolved_from"]), cert.spec, cert.profile, cert.model,
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


def coverage_lines(cert: Certificate) -> list[str]:
    """The "Coverage" section of report.md: each class, met or not and why (docs/adapter.md)."""
    cov = cert.coverage
    out = ["## Coverage", "", f"{cov.describe()}. Largest class met: "
           f"**{cov.met or 'none'}**" + (f" (required: `{cert.required}`)" if cert.required
                                         else "") + ".", "", "| class | met | what it needs |",
           "|---|---|---|"]
    for cls in CLASSES:
        gap = cov.gaps.get(cls.name)
        out.append(f"| {cls.name} | {'no: ' + gap if gap else 'yes'} | {cls.meaning} |")
    return [*out, ""]


def tier_share(t: TierSummary) -> str:
    """``14 of 17``: the tier's checks that ran (passed, failed or known) of those collected."""
    ran = sum(t.counts.get(o, 0) for o in RAN)
    return f"{ran} of {sum(t.counts.values())}"


def tier_table(cert: Certificate) -> str:
    lines = ["| tier | ran | " + " | ".join(OUTCOMES) + " | seconds | status |",
             "|---|---|" + "---|" * (len(OUTCOMES) + 2)]
    for t in cert.tiers:
        counts = " | ".join(str(t.counts.get(o, 0)) for o in OUTCOMES)
        lines.append(f"| {t.tier} | {tier_share(t)} | {counts} | {t.seconds} | "
                     f"**{t.status}** |")
    return "\n".join(lines)


def matrix_table(cert: Certificate) -> str:
    tiers = [t.tier for t in cert.tiers]
    lines = ["| capability | claimed | " + " | ".join(tiers) + " |",
             "|---|---|" + "---|" * len(tiers)]
    for cap, cells in sorted(cert.matrix.items()):
        name = cap.split(":", 1)[-1]
        claimed = (name in cert.capabilities.get("algorithms", []) if cap.startswith("algorithm:")
                   else bool(cert.capabilities.get(cap)))
        row = " | ".join(cells.get(t, "—") for t in tiers)
        lines.append(f"| {cap} | {'yes' if claimed else 'no'} | {row} |")
    return "\n".join(lines)


ACCEPTANCE_PNG = "acceptance.png"


def _shown(value: object) -> str:
    return "—" if value is None or value == "" else str(value)


def configurations_table(cert: Certificate) -> str:
    lines = ["| configuration | algorithm | draft model | S (num_steps) | k (topk) | "
             "N (num_draft_tokens) | overlap | τ lossless (checks) | "
             "τ golden tier: backend / golden |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cert.configurations:
        p = c.parameters
        tau = f"{c.tau} ({c.tau_checks})" if c.tau is not None else "—"
        golden = (f"{c.golden_tau} / {_shown(c.golden_reference_tau)}"
                  if c.golden_tau is not None else "—")
        lines.append(f"| `{c.id}` | {p.get('algorithm')} | {_shown(p.get('draft_model'))} | "
                     f"{_shown(p.get('num_steps'))} | {_shown(p.get('topk'))} | "
                     f"{_shown(p.get('num_draft_tokens'))} | {_shown(p.get('overlap'))} | "
                     f"{tau} | {golden} |")
    return "\n".join(lines)


def certified_lines(cert: Certificate) -> list[str]:
    """What was certified: backend, precision, spec, every configuration's parameters and τ,
    the near-ties."""
    b = cert.backend
    timeout = ("no limit" if not cert.case_timeout
               else f"{cert.case_timeout:g} s per phase of a check")
    out = ["## What was certified", "",
           f"- backend: `{b['name']}` version `{b['version']}`",
           f"- adapter contract it was written for: `{b.get('contract_version', 'not recorded')}`",
           f"- precision the backend declares: `{cert.precision}`",
           f"- spec: `{cert.spec}`, profile: `{cert.profile}`, graphs: `{cert.graphs or 'off'}`, "
           f"device: `{cert.device}`",
           f"- case timeout: {timeout}",
           f"- near-ties: {len(cert.near_ties)}", ""]
    if cert.configurations:
        out += ["τ: tokens per verify step, bonus included (plain decoding has none).", "",
                configurations_table(cert), ""]
    if cert.near_ties:
        out += ["Near-ties (the backend diverged where the reference's top-2 margin is below "
                "the bound for its declared precision; listed, not failed):", ""]
        out += [f"- `{t['check']}`: {t['near_tie']}" for t in cert.near_ties]
        out.append("")
    return out


def _values(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def acceptance_lines(cert: Certificate) -> list[str]:
    panels = cert.acceptance_panels
    if not panels:
        return ["## Acceptance", "", "No accept-length histogram: the golden tier did not run "
                "(it needs `reference_draft` and `acceptance_stats`, and a speculative spec).",
                ""]
    out = ["## Acceptance", ""]
    if cert.plot_skipped:
        out += [f"`{ACCEPTANCE_PNG}` skipped: {cert.plot_skipped}.", ""]
    else:
        out += [f"![accept-length histogram and per-position acceptance, backend vs golden]"
                f"({ACCEPTANCE_PNG})", "",
                f"`{ACCEPTANCE_PNG}`: one panel per configuration, top to bottom ("
                + ", ".join(f"`{p.config}`" for p in panels) + "); in each, the accept-length "
                "histogram (share of verify steps per accept length) and beside it the "
                "per-position acceptance rate, the backend (blue) against the golden trace "
                "(orange), on the golden tier's prompts.", ""]
    out += ["Accept length: tokens per verify step, bonus included. Acceptance at draft position "
            "i: the share of verify steps that accepted at least i drafted tokens.", "",
            "| configuration | verify steps: backend / golden | share per accept length "
            "1, 2, ...: backend | golden | acceptance at draft position 1, 2, ...: backend | "
            "golden |", "|---|---|---|---|---|---|"]
    for p in panels:
        hists = (p.backend, p.golden)
        lengths = [_values(shares(h, p.lengths)) for h in hists]
        rates = [_values(per_position_rates(h, p.positions)) for h in hists]
        out.append(f"| `{p.config}` | {sum(p.backend.values())} / {sum(p.golden.values())} | "
                   + " | ".join([*lengths, *rates]) + " |")
    out.append("")
    return out


def self_check_lines(self_checks: list[dict[str, str]]) -> list[str]:
    if not self_checks:
        return []
    out = ["## Suite self-checks", "",
           "These checks test the suite itself (the power of its statistical tests, the "
           "derivations they rest on) and exercise no part of the backend: they are not counted "
           "in the tiers above. A failed one means the suite cannot vouch for the checks that "
           "depend on it, so the run fails.", "", "| check | outcome | message |", "|---|---|---|"]
    out += [f"| `{c['check']}` | {c['outcome']} | {c['message'][:200] or '—'} |"
            for c in self_checks]
    return [*out, ""]


def backend_progress_lines(checks: list[dict[str, object]]) -> list[str]:
    """The "Backend progress" section of report.md: the progress lines the backend wrote
    during the checks (``conformance.report.progress.BACKEND_PROGRESS``), by check; nothing
    when it wrote none."""
    said = [(str(c["nodeid"]), str(line)) for c in sorted(checks, key=lambda c: str(c["nodeid"]))
            for line in c.get("progress") or []]  # type: ignore[attr-defined]
    if not said:
        return []
    return ["## Backend progress", "",
            "What the backend said of its own work during the checks (such as compiling a "
            "graph key, once per machine), by the check it happened in:", "",
            *(f"- {line} (`{nodeid}`)" for nodeid, line in said), ""]


def render_markdown(cert: Certificate, where: Path = Path(".")) -> str:
    """report.md; ``where``: the certificate directory as the user named it (replay commands
    name their repro files under it)."""
    b = cert.backend
    out = [f"# specgate certificate: {b['name']} {b['version']}", "",
           f"- result: **{full_headline(cert)}**",
           f"- spec: `{cert.spec}`, profile: `{cert.profile}`, graphs: "
           f"`{cert.graphs or 'off'}`, device: `{cert.device}`",
           f"- backend resolved from: `{b['resolved_from']}`",
           f"- specgate: `{cert.specgate_version or 'unknown'}`"
           + (f", shard: `{cert.shard}`" if cert.shard else "")
           + (f", checks selected by `{cert.selection}`" if cert.selection else ""),
           f"- created: {cert.created}", ""]
    if cert.interrupted:
        out += [f"**The run was interrupted.** This certificate covers the {cert.total_checks} "
                "checks that finished before it stopped; the checks that did not run are not "
                "in it, and it certifies nothing.", ""]
    if cert.vacuous:
        out += [f"**Vacuous run refused:** {cert.vacuous}", ""]
    if cert.unmet:
        out += [f"**`--require {cert.required}` failed:** {cert.unmet}", ""]
    out += coverage_lines(cert)
    out += certified_lines(cert)
    out += ["## Tiers", "", tier_table(cert), "",
            "## Capability × tier", "",
            "Each cell: the status of the checks in that tier that need the capability. "
            "\"not claimed\" means the backend does not declare it: nothing was certified.", "",
            matrix_table(cert), ""]
    if cert.unclaimed_reasons:
        out += ["## Not claimed, and why", "", "As the backend explains it:", ""]
        out += [f"- `{cap}`: {why}" for cap, why in sorted(cert.unclaimed_reasons.items())]
        out.append("")
    not_run = [(t.tier, why, n) for t in cert.tiers for why, n in t.not_run.items()]
    if not_run:
        out += ["## Checks that did not run, and why", "", "| tier | checks | why |",
                "|---|---|---|"]
        out += [f"| {tier} | {n} | {why} |" for tier, why, n in not_run]
        out.append("")
    out += self_check_lines(cert.self_checks)
    out += failure_lines(cert.failures, rerun_of(cert), where)
    out += known_lines(cert.known_failures, rerun_of(cert).backend, where)
    out += acceptance_lines(cert)
    out += figures_lines(cert.checks)
    out += backend_progress_lines(cert.checks)
    out += ["## Environment", ""] + [f"- {k}: {'none' if v is None else v}"
                                     for k, v in cert.environment.items()]
    return "\n".join(out) + "\n"


def write_reports(cert: Certificate, directory: Path, where: Path | None = None) -> None:
    """report.md, report.json (and acceptance.png) into ``directory``; ``where``: the path the
    user will find it under (default ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.md").write_text(render_markdown(cert, where or directory))
    (directory / "report.json").write_text(cert.to_json() + "\n")
    if cert.acceptance_panels and not cert.plot_skipped:
        save_acceptance(cert.acceptance_panels, directory / ACCEPTANCE_PNG)


def indent_junit(path: Path) -> None:
    """pytest writes junit.xml on one line; indent it so a diff or a reader can follow it."""
    tree = ET.parse(path)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def summary_rows(certs: list[Certificate]) -> tuple[list[str], list[list[str]]]:
    """A run over several specs, one row per spec: its result and its tiers' statuses."""
    tiers = sorted({t.tier for c in certs for t in c.tiers})
    rows = []
    for c in certs:
        status = {t.tier: t.status for t in c.tiers}
        rows.append([c.spec, headline(c), f"{c.coverage.ran} of {c.coverage.total}",
                     c.coverage.met or "none", *(status.get(t, "—") for t in tiers)])
    return ["spec", "result", "ran", "coverage", *tiers], rows


def summary_markdown(certs: list[Certificate]) -> str:
    columns, rows = summary_rows(certs)
    lines = ["# specgate certificates, every spec", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Each spec's certificate is in its own directory (`<spec>/report.md`)."]
    return "\n".join(lines) + "\n"
