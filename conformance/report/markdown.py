"""report.md: the certificate for a reader (the coverage classes, what was certified, the tier
table, the capability × tier matrix, what did not run and why, the self-checks, failures and
known failures with the commands that replay them, acceptance, figures, the backend's progress
lines and the environment), and ``write_reports``, which writes it beside report.json and
acceptance.png."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from conformance.report.acceptance_chart import per_position_rates, save_acceptance, shares
from conformance.report.certificate import (
    Certificate,
    SelfCheck,
    full_headline,
    rerun_of,
    tier_share,
)
from conformance.report.coverage import CLASSES, claims
from conformance.report.failures import failure_lines, known_lines
from conformance.report.figures import figures_lines
from conformance.report.results import CheckRow
from conformance.report.verdict import OUTCOMES

ACCEPTANCE_PNG = "acceptance.png"


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
        claimed = claims(cert.capabilities, cap)
        row = " | ".join(cells.get(t, "—") for t in tiers)
        lines.append(f"| {cap} | {'yes' if claimed else 'no'} | {row} |")
    return "\n".join(lines)


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
           f"- backend: `{b.name}` version `{b.version}`",
           f"- adapter contract it was written for: `{b.contract_version or 'not recorded'}`",
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
        out += [f"- `{t.check}`: {t.near_tie}" for t in cert.near_ties]
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


def self_check_lines(self_checks: list[SelfCheck]) -> list[str]:
    if not self_checks:
        return []
    out = ["## Suite self-checks", "",
           "These checks test the suite itself (the power of its statistical tests, the "
           "derivations they rest on) and exercise no part of the backend: they are not counted "
           "in the tiers above. A failed one means the suite cannot vouch for the checks that "
           "depend on it, so the run fails.", "", "| check | outcome | message |", "|---|---|---|"]
    out += [f"| `{c.check}` | {c.outcome} | {c.message[:200] or '—'} |" for c in self_checks]
    return [*out, ""]


def backend_progress_lines(checks: Sequence[CheckRow]) -> list[str]:
    """The "Backend progress" section of report.md: the progress lines the backend wrote
    during the checks (``conformance.report.progress.BACKEND_PROGRESS``), by check; nothing
    when it wrote none."""
    said = [(c.nodeid, line) for c in sorted(checks, key=lambda c: c.nodeid)
            for line in c.progress]
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
    out = [f"# specgate certificate: {b.name} {b.version}", "",
           f"- result: **{full_headline(cert)}**",
           f"- spec: `{cert.spec}`, profile: `{cert.profile}`, graphs: "
           f"`{cert.graphs or 'off'}`, device: `{cert.device}`",
           f"- backend resolved from: `{b.resolved_from}`",
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
