"""``specgate report durations DIR... --out FILE``: the table ``--shard`` balances by
(``conformance.run.shard``), recorded from certificates: per spec, each check's seconds as
report.json gives them (the mean where several certificates ran it)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from conformance.plan.usage import UsageError
from conformance.report.cert_dirs import read_cert_dir
from conformance.report.files import output_file, write_atomically


def durations_table(dirs: list[Path]) -> dict[str, dict[str, float]]:
    """Spec -> node id -> seconds, from the certificates in ``dirs``."""
    seen: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in dirs:
        for spec, files in read_cert_dir(path).specs.items():
            for check in files.results.checks:
                seen[spec][check.nodeid].append(check.duration)
    return {spec: {n: round(sum(s) / len(s), 3) for n, s in sorted(rows.items())}
            for spec, rows in sorted(seen.items())}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="report directories")
    parser.add_argument("--out", required=True, help="the durations file to write")


def cmd_durations(args: argparse.Namespace) -> int:
    out = output_file(args.out, "--out")
    try:
        table = durations_table([Path(d) for d in args.dirs])
    except ValueError as err:
        raise UsageError(str(err)) from None
    write_atomically(out, json.dumps({"format": 1, "durations": table}, indent=1) + "\n")
    counts = ", ".join(f"{spec} {len(rows)}" for spec, rows in table.items())
    print(f"durations: {out} ({counts} checks)")
    return 0
