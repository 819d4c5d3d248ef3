"""summary.md and the every-spec rows of a run over several specs (``--spec all|claimed``, or
such a run's shards merged): a row per spec with its result, coverage and tiers' statuses."""

from __future__ import annotations

from conformance.report.certificate import Certificate, headline


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
