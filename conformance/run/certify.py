"""``specgate certify``: run the suite for each spec into the report directory."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.report.console import print_certificate, print_table
from conformance.run.usage import Interrupted, UsageError, validate

if TYPE_CHECKING:
    from rich.console import Console

    from conformance.report.certificate import Certificate
    from conformance.run.specs import SpecChoice
    from conformance.run.suite import SuiteRun


def pytest_problem(run: SuiteRun) -> str:
    """Why pytest could not run the suite, as pytest reported it."""
    return "\n".join(run.problems) or f"pytest exit code {run.exit_code}"


def _certify_one(args: argparse.Namespace, spec: SpecChoice, out_dir: Path,
                 console: Console) -> tuple[Certificate | None, bool]:
    """Run the suite for one spec into ``out_dir``; returns the certificate (None if pytest
    could not run the suite) and whether the run was interrupted."""
    import pytest

    from conformance.report.certificate import build_certificate, indent_junit, write_reports
    from conformance.report.progress import TierProgress
    from conformance.run.suite import SuiteOptions, run_suite

    console.print(f"specgate certify: backend {args.backend}, spec {spec.name}, profile "
                  f"{args.profile}, graphs {args.graphs or 'off'}, {args.workers} worker(s)")
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / "junit.xml"
    opts = SuiteOptions(args.backend, spec.name, args.profile, args.model, args.draft_model,
                        workers=args.workers, graphs=args.graphs,
                        case_timeout=args.case_timeout)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_suite(opts, Path(tmp) / "results.json", junit, (TierProgress(console),))
    if junit.exists():
        indent_junit(junit)
    if run.exit_code == pytest.ExitCode.USAGE_ERROR:  # its message is on stderr already
        raise UsageError("pytest refused the suite's arguments (see its message above)")
    if run.results is None or (not run.interrupted and run.exit_code in (
            pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR)):
        if not run.interrupted:
            console.print(f"specgate certify: pytest could not run the suite:\n"
                          f"{pytest_problem(run)}", markup=False)
        return None, run.interrupted
    cert = build_certificate(run.results)
    write_reports(cert, out_dir)
    return cert, run.interrupted


def cmd_certify(args: argparse.Namespace) -> int:
    from conformance.report.certificate import summary_markdown, summary_rows
    from conformance.report.progress import stderr_console
    from conformance.report.report_dir import ReportDir, ReportDirError
    from conformance.run.specs import resolve_specs

    (backend,) = validate(args.spec, [args.backend], args.model, args.draft_model)
    if args.graphs and not backend.capabilities().graph_runner:
        raise UsageError(f"--graphs: backend {args.backend!r} does not claim graph_runner")
    specs = resolve_specs(args.spec)
    try:
        target = ReportDir(Path(args.report))
    except ReportDirError as err:
        raise UsageError(str(err)) from None
    console = stderr_console()
    certs: list[Certificate] = []
    interrupted = ran_all = False
    try:
        for spec in specs:
            out_dir = target.staging / spec.name if args.spec == "all" else target.staging
            cert, interrupted = _certify_one(args, spec, out_dir, console)
            if cert is not None:
                certs.append(cert)
                print_certificate(cert, target.target / out_dir.relative_to(target.staging))
            if interrupted or cert is None:
                break
        else:
            ran_all = True
        if args.spec == "all" and certs:
            (target.staging / "summary.md").write_text(summary_markdown(certs))
            print_table("specgate certify: every spec", *summary_rows(certs))
        target.commit()
    except BaseException:
        target.discard()  # the previous report stays, whole
        raise
    if interrupted:
        checks = sum(c.total_checks for c in certs)
        raise Interrupted(f"certify stopped; the certificate in {args.report} is marked "
                          f"INCOMPLETE and covers the {checks} checks that finished")
    return 0 if ran_all and all(c.status == "passed" for c in certs) else 1
