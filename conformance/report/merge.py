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
inside ``--out`` (``untrusted.contained``), and a shard whose report.json lacks a field the
certificate is built from, or holds one of the wrong type, is refused with one line, before
anything is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.plan.specs import SPECS
from conformance.plan.usage import UsageError
from conformance.report.cert_dirs import CertDir, SpecFiles, read_cert_dir
from conformance.report.results import KnownReport, RunResults
from conformance.report.verdict import vacuous_reason
from specwire.untrusted import UntrustedFileError, contained

if TYPE_CHECKING:
    from conformance.report.certificate import Certificate
    from conformance.report.report_dir import ReportDir

# what every shard of one run records alike: RunResults' field, what the message calls it
SAME = (("specgate_version", "specgate versions"), ("backend", "backends"),
        ("profile", "profiles"), ("graphs", "graph executors"), ("device", "devices"),
        ("selection", "selections (--only, -k)"), ("require", "--require classes"),
        ("model", "models"), ("draft_model", "draft models"))


@dataclass(frozen=True)
class Shards:
    """The shards' certificates of one spec, in shard order."""

    spec: str
    files: list[SpecFiles]


def _shard_of(cert: CertDir) -> tuple[int, int] | None:
    marks = {f.results.shard for f in cert.specs.values()}
    if len(marks) != 1:
        raise ValueError(f"{cert.path}: its specs were certified as different shards")
    mark = marks.pop()
    if mark is None:
        return None
    index, _, count = mark.partition("/")
    return int(index), int(count)


def _check_alike(certs: list[CertDir]) -> None:
    """ValueError unless every shard records what ``SAME`` lists alike, and the same layout
    and specs."""
    first = next(iter(certs[0].specs.values())).results
    for cert in certs:
        for files in cert.specs.values():
            for key, what in SAME:
                if getattr(files.results, key) != getattr(first, key):
                    raise ValueError(f"shards of different {what}: {certs[0].path} has "
                                     f"{getattr(first, key)!r}, {files.directory} has "
                                     f"{getattr(files.results, key)!r}")
    if len({c.multi for c in certs}) > 1:
        raise ValueError("shards of different layouts: some certify one spec, some several")
    if len({frozenset(c.specs) for c in certs}) > 1:
        raise ValueError("shards of different specs: " + "; ".join(
            f"{c.path}: {', '.join(c.specs)}" for c in certs))


def _check_marks(marks: list[tuple[int, int] | None]) -> None:
    """ValueError unless the certificates are all shards, each 1..N once, or none is."""
    given = [m for m in marks if m is not None]
    if given and len(given) != len(marks):
        raise ValueError("some of the certificates are shards (--shard) and some are not")
    if not given:
        return
    counts = {count for _, count in given}
    if len(counts) > 1:
        raise ValueError(f"shards of different shard counts: {sorted(counts)}")
    (count,) = counts
    indices = sorted(index for index, _ in given)
    if indices != list(range(1, count + 1)):
        raise ValueError(f"shards {', '.join(map(str, indices))} of {count} given: each "
                         f"shard 1..{count} exactly once")


def _check_disjoint(group: Shards) -> None:
    """ValueError if a check or a repro file is in two shards, or only some shards were
    certified with known failures."""
    seen: dict[str, Path] = {}
    for files in group.files:
        for check in files.results.checks:
            if check.nodeid in seen:
                raise ValueError(f"overlapping shards: {check.nodeid} (spec {group.spec}) is in "
                                 f"{seen[check.nodeid]} and {files.directory}")
            seen[check.nodeid] = files.directory
    names = [p.name for f in group.files for p in f.repro_files]
    if len(names) != len(set(names)):
        raise ValueError(f"overlapping shards: spec {group.spec} has repro files of the "
                         "same name in two shards")
    if len({f.results.known_failures is None for f in group.files}) > 1:
        raise ValueError("some shards were certified with --known-failures, some without")


def check_shards(certs: list[CertDir]) -> list[Shards]:
    """The shards per spec; ValueError (one line) if they do not belong together."""
    _check_alike(certs)
    marks = [_shard_of(c) for c in certs]
    _check_marks(marks)
    order = sorted(range(len(certs)), key=lambda i: marks[i] or (i, 0))
    known = list(SPECS)
    specs = sorted(certs[0].specs, key=lambda s: (known.index(s) if s in known else len(known), s))
    grouped = [Shards(s, [certs[i].specs[s] for i in order if s in certs[i].specs])
               for s in specs]
    for group in grouped:
        _check_disjoint(group)
    return grouped


def _known(reports: list[KnownReport]) -> KnownReport | None:
    """The shards' known-failures records as one: an id is unknown only if no shard had it."""
    if not reports:
        return None
    everywhere = set.intersection(*({u.check for u in r.unknown} for r in reports))
    return replace(reports[0], known=tuple(i for r in reports for i in r.known),
                   stale=tuple(i for r in reports for i in r.stale),
                   expired=tuple(i for r in reports for i in r.expired),
                   not_run=tuple(i for r in reports for i in r.not_run),
                   unknown=tuple(u for u in reports[0].unknown if u.check in everywhere))


def merged_results(group: Shards) -> RunResults:
    """The results ``build_certificate`` takes, from the shards' report.json."""
    shards = [f.results for f in group.files]
    first = shards[0]
    checks = tuple(c for r in shards for c in r.checks)
    interrupted = any(r.interrupted for r in shards)
    count = len(shards)
    return replace(
        first, spec=group.spec, checks=checks, interrupted=interrupted, collected={},
        vacuous=None if interrupted else vacuous_reason(checks),  # incomplete, not vacuous
        threads=tuple(sorted({t for r in shards for t in r.threads})),
        shard=f"merged from {count} shard{'s' * (count != 1)}" if first.shard else None,
        known_failures=_known([r.known_failures for r in shards if r.known_failures]))


def _merge_spec(group: Shards, target: ReportDir, multi: bool
                ) -> tuple[Certificate, Path] | None:
    """One spec's merged certificate written into the staging directory, with its junit.xml
    and repro files; None for a spec the selection names no check of (said on stderr)."""
    from conformance.report.certificate import build_certificate
    from conformance.report.junit import merge_junit
    from conformance.report.markdown import write_reports
    from conformance.report.report_dir import REPRO_DIR

    first = group.files[0].results
    if multi and first.selection and not any(f.results.checks for f in group.files):
        print(f"specgate report merge: spec {group.spec}: no check matches "
              f"{first.selection}", file=sys.stderr)
        return None
    out_dir = contained(target.staging, group.spec) if multi else target.staging
    shown = target.target / out_dir.relative_to(target.staging)
    cert = build_certificate(merged_results(group))
    write_reports(cert, out_dir, shown)
    merge_junit([f.junit for f in group.files if f.junit.exists()], out_dir / "junit.xml")
    for repro in (p for f in group.files for p in f.repro_files):
        (out_dir / REPRO_DIR).mkdir(exist_ok=True)
        shutil.copyfile(repro, out_dir / REPRO_DIR / repro.name)
    return cert, shown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="the shards' report directories")
    parser.add_argument("--out", required=True, help="the merged certificate's directory "
                        "(replaced as a whole, like certify's --report)")


def cmd_merge(args: argparse.Namespace) -> int:
    from conformance.report.console import print_certificate, print_summary
    from conformance.report.report_dir import ReportDir
    from conformance.report.summary import summary_markdown

    try:  # a bad shard or --out (ReportDirError) is one line, before anything is written
        certs = [read_cert_dir(Path(d)) for d in args.dirs]
        groups = check_shards(certs)
        target = ReportDir(Path(args.out), "--out")
    except ValueError as err:
        raise UsageError(str(err)) from None
    multi = certs[0].multi
    try:
        merged = [m for m in (_merge_spec(g, target, multi) for g in groups) if m is not None]
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
