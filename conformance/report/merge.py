"""``specgate report merge DIR... --out DIR``: the shards' certificates (``certify --shard``)
joined into one: report.md, report.json, junit.xml, acceptance.png and repro files per spec,
summary.md for a multi-spec run. Written like certify's (``ReportDir``: all or nothing).

Shards must come from one run's set-up: the same specgate version, backend (name, version,
where it was resolved from), profile, graphs, device, selection (``--only``/``-k``), specs,
layout and shard count, each shard exactly once, and no check in two shards; anything else is
refused before anything is written. The merged certificate is built from the shards' checks as
certify builds one (a vacuous merge fails as a vacuous run does); known failures carry over, and
an id is unknown only if no shard had it. As in certify, a spec in which the selection names no
check in any shard gets no certificate. Shards come from other machines: their files are read
as untrusted data (``cert_dirs``, ``junit.read_junit``), a spec name becomes a directory only
inside ``--out`` (``untrusted.contained``), and a shard whose report.json lacks what the
certificate is built from is refused with one line, before anything is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from conformance.plan.specs import SPECS
from conformance.plan.usage import UsageError
from conformance.report.cert_dirs import CertDir, SpecFiles, read_cert_dir
from conformance.report.failures import DEFAULT_MODEL
from conformance.report.verdict import vacuous_reason
from specwire.untrusted import UntrustedFileError, contained

# what every shard of one run records alike
SAME = (("specgate_version", "specgate versions"), ("backend", "backends"),
        ("profile", "profiles"), ("graphs", "graph executors"), ("device", "devices"),
        ("selection", "selections (--only, -k)"), ("required", "--require classes"),
        ("model", "models"), ("draft_model", "draft models"))
_KINDS = ("known", "stale", "expired", "not_run")


@dataclass(frozen=True)
class Shards:
    """The shards' certificates of one spec, in shard order."""

    spec: str
    files: list[SpecFiles]


def _shard_of(cert: CertDir) -> tuple[int, int] | None:
    marks = {f.report.get("shard") for f in cert.specs.values()}
    if len(marks) != 1:
        raise ValueError(f"{cert.path}: its specs were certified as different shards")
    mark = marks.pop()
    if mark is None:
        return None
    index, _, count = str(mark).partition("/")
    return int(index), int(count)


def check_shards(certs: list[CertDir]) -> list[Shards]:
    """The shards per spec; ValueError (one line) if they do not belong together."""
    first = next(iter(certs[0].specs.values())).report
    for cert in certs:
        for files in cert.specs.values():
            for key, what in SAME:
                if files.report.get(key) != first.get(key):
                    raise ValueError(f"shards of different {what}: {certs[0].path} has "
                                     f"{first.get(key)!r}, {files.directory} has "
                                     f"{files.report.get(key)!r}")
    if len({c.multi for c in certs}) > 1:
        raise ValueError("shards of different layouts: some certify one spec, some several")
    if len({frozenset(c.specs) for c in certs}) > 1:
        raise ValueError("shards of different specs: " + "; ".join(
            f"{c.path}: {', '.join(c.specs)}" for c in certs))
    marks = [_shard_of(c) for c in certs]
    if any(m is None for m in marks) and any(m is not None for m in marks):
        raise ValueError("some of the certificates are shards (--shard) and some are not")
    if marks[0] is not None:
        counts = {m[1] for m in marks}  # type: ignore[index]
        if len(counts) > 1:
            raise ValueError(f"shards of different shard counts: {sorted(counts)}")
        (count,) = counts
        indices = sorted(m[0] for m in marks)  # type: ignore[index]
        if indices != list(range(1, count + 1)):
            raise ValueError(f"shards {', '.join(map(str, indices))} of {count} given: each "
                             f"shard 1..{count} exactly once")
    order = sorted(range(len(certs)), key=lambda i: marks[i] or (i, 0))
    known = list(SPECS)
    specs = sorted(certs[0].specs, key=lambda s: (known.index(s) if s in known else len(known), s))
    grouped = [Shards(s, [certs[i].specs[s] for i in order if s in certs[i].specs])
               for s in specs]
    for group in grouped:
        seen: dict[str, Path] = {}
        for files in group.files:
            for check in files.report["checks"]:  # type: ignore[attr-defined]
                nodeid = str(check["nodeid"])
                if nodeid in seen:
                    raise ValueError(f"overlapping shards: {nodeid} (spec {group.spec}) is in "
                                     f"{seen[nodeid]} and {files.directory}")
                seen[nodeid] = files.directory
        names = [p.name for f in group.files for p in f.repro_files]
        if len(names) != len(set(names)):
            raise ValueError(f"overlapping shards: spec {group.spec} has repro files of the "
                             "same name in two shards")
        if len({f.report.get("known_failures") is None for f in group.files}) > 1:
            raise ValueError("some shards were certified with --known-failures, some without")
    return grouped


def _known(reports: list[dict[str, object]]) -> dict[str, object] | None:
    known = [r["known_failures"] for r in reports]
    if known[0] is None:
        return None
    merged = {**known[0], **{k: [i for r in known for i in r[k]] for k in _KINDS}}  # type: ignore[index]
    everywhere = set.intersection(*({str(u["check"]) for u in r["unknown"]} for r in known))  # type: ignore[index]
    merged["unknown"] = [u for u in known[0]["unknown"] if u["check"] in everywhere]  # type: ignore[index]
    return merged


def merged_results(group: Shards) -> dict[str, object]:
    """The results ``build_certificate`` takes, from the shards' report.json."""
    reports = [f.report for f in group.files]
    first = reports[0]
    checks = [c for r in reports for c in r["checks"]]  # type: ignore[attr-defined]
    interrupted = any(r.get("interrupted") for r in reports)
    # an incomplete certificate says so instead of being vacuous
    vacuous = None if interrupted else vacuous_reason(checks)
    count = len(reports)
    return {
        "backend": first["backend"], "capabilities": first["capabilities"],
        "spec": group.spec, "profile": first["profile"], "graphs": first.get("graphs"),
        "device": first.get("device", "cpu"), "model": first.get("model", DEFAULT_MODEL),
        "draft_model": first.get("draft_model"),
        "unclaimed_reasons": first.get("unclaimed_reasons", {}),
        "configurations": [{"id": c["id"], **c["parameters"]}
                           for c in first.get("configurations", [])],  # type: ignore[attr-defined]
        "precision": first.get("precision", "float32"), "case_timeout": first.get("case_timeout"),
        "threads": sorted({t for r in reports for t in r.get("threads", [])}),  # type: ignore[attr-defined]
        "specgate_version": first.get("specgate_version"), "selection": first.get("selection"),
        "shard": f"merged from {count} shard{'s' * (count != 1)}" if first.get("shard") else None,
        "vacuous": vacuous, "interrupted": interrupted, "checks": checks,
        "known_failures": _known(reports), "require": first.get("required")}


def cmd_merge(args: argparse.Namespace) -> int:
    from conformance.report.certificate import (
        build_certificate,
        summary_markdown,
        write_reports,
    )
    from conformance.report.console import print_certificate, print_summary
    from conformance.report.junit import merge_junit
    from conformance.report.report_dir import REPRO_DIR, ReportDir, ReportDirError

    try:
        certs = [read_cert_dir(Path(d)) for d in args.dirs]
        groups = check_shards(certs)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        target = ReportDir(Path(args.out), "--out")
    except ReportDirError as err:
        raise UsageError(str(err)) from None
    multi = certs[0].multi
    merged = []
    try:
        for group in groups:
            first = group.files[0].report
            if multi and first.get("selection") and not any(f.report["checks"]
                                                             for f in group.files):
                print(f"specgate report merge: spec {group.spec}: no check matches "
                      f"{first['selection']}", file=sys.stderr)
                continue
            out_dir = contained(target.staging, group.spec) if multi else target.staging
            shown = target.target / out_dir.relative_to(target.staging)
            try:
                cert = build_certificate(merged_results(group))
                cert.environment = dict(group.files[0].report["environment"])  # type: ignore[arg-type]
                write_reports(cert, out_dir, shown)
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise UsageError(f"spec {group.spec}: the shards' report.json lack what a "
                                 f"certificate is built from ({type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:200]})") from None
            merge_junit([f.junit for f in group.files if f.junit.exists()], out_dir / "junit.xml")
            for repro in (p for f in group.files for p in f.repro_files):
                (out_dir / REPRO_DIR).mkdir(exist_ok=True)
                shutil.copyfile(repro, out_dir / REPRO_DIR / repro.name)
            merged.append((cert, shown))
        if multi:
            (target.staging / "summary.md").write_text(summary_markdown([c for c, _ in merged]))
        target.commit()
    except UntrustedFileError as err:
        target.discard()
        raise UsageError(str(err)) from None
    except BaseException:
        target.discard()
        raise
    for cert, shown in merged:
        print_certificate(cert, shown)
    if multi:
        print_summary("specgate report merge: every spec", [c for c, _ in merged],
                      target.target / "summary.md")
    if not merged:
        print("specgate report merge: no check of any spec matches the selection",
              file=sys.stderr)
    return 0 if merged and all(c.status == "passed" for c, _ in merged) else 1
