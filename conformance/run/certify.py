"""``specgate certify``: run the suite for each spec into the report directory.

Before any work, the arguments become one run plan, checked once (``certify_plan``:
``conformance.plan.run_plan.build_plan``, the backend opened once on the model); each spec's
pytest session gets that plan, narrowed to the spec, as ``--specgate-plan``.
``--spec claimed`` (the default) certifies every spec the backend claims (its algorithm, and
the tree and overlap capabilities the spec needs), one certificate per spec as ``--spec all``
does. The results of each spec's run are finished here before they become its certificate:
the specgate version and shard are recorded, and the known-failures file is applied
(``conformance.run.known_failures``), its known failures marked in junit.xml too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.plan.arguments import add_graphs_argument, count, seconds, timeout_help
from conformance.plan.device import DEVICE_HELP, device_arg
from conformance.plan.run_plan import RunPlan, build_plan
from conformance.plan.usage import Interrupted, UsageError
from conformance.report.console import print_certificate, print_summary
from specwire.untrusted import contained

if TYPE_CHECKING:
    from rich.console import Console

    from conformance.report.certificate import Certificate
    from conformance.report.report_dir import ReportDir
    from conformance.report.results import RunResults
    from conformance.run.known_failures import KnownFailure
    from conformance.run.suite import SuiteRun

MULTI_SPEC = ("all", "claimed")  # one certificate per spec, in <report>/<spec>/


def pytest_problem(run: SuiteRun) -> str:
    """Why pytest could not run the suite, as pytest reported it."""
    return "\n".join(run.problems) or f"pytest exit code {run.exit_code}"


@dataclass(frozen=True)
class Selection:
    """Which checks this run runs (``--only``, ``-k``, ``--shard``)."""

    only: tuple[str, ...] = ()
    keyword: str | None = None
    shard: str | None = None

    def __bool__(self) -> bool:
        return bool(self.only or self.keyword or self.shard)

    @property
    def by_name(self) -> str | None:
        """``--only`` and ``-k`` as a phrase (None: every check); report.json records it."""
        parts = [*(["--only " + ",".join(self.only)] if self.only else []),
                 *([f"-k {self.keyword!r}"] if self.keyword else [])]
        return ", ".join(parts) or None

    def describe(self) -> str:
        return ", ".join([*([self.by_name] if self.by_name else []),
                          *([f"--shard {self.shard}"] if self.shard else [])])

    def drops(self, results: RunResults) -> bool:
        """A spec in which ``--only``/``-k`` name no check gets no certificate of its own under
        ``--spec all|claimed``; a shard keeps it (vacuous), so every shard holds every spec and
        ``report merge`` decides over the union."""
        return bool(self.by_name and not self.shard and not results.checks)


@dataclass(frozen=True)
class Finish:
    """What turns one spec's results into its certificate."""

    selection: Selection
    known: list[KnownFailure] | None
    known_file: str
    strict_known: bool
    require: str | None = None  # --require: a coverage class the run must meet


def _finish(results: RunResults, finish: Finish, junit: Path) -> RunResults:
    """The suite's results as the certificate takes them: the specgate version, shard,
    selection and ``--require`` recorded, the known failures applied (junit.xml marked too)."""
    from conformance.report.junit import mark_incomplete, mark_known
    from conformance.run.known_failures import apply_known
    from conformance.version import specgate_version

    sel = finish.selection
    vacuous = results.vacuous
    if sel and vacuous == "zero checks collected":
        vacuous = f"zero checks collected: no check matches {sel.describe()}"
    results = replace(results, specgate_version=specgate_version(), shard=sel.shard,
                      selection=sel.by_name, require=finish.require, vacuous=vacuous)
    if results.interrupted:
        mark_incomplete(junit, len(results.checks), sum(results.collected.values()))
    if finish.known is not None:
        results = apply_known(results, finish.known, finish.known_file, finish.strict_known,
                              date.today())
        mark_known(junit, {c.nodeid: c.known_reason for c in results.checks
                           if c.known_reason is not None})
    return results


def _certify_one(plan: RunPlan, out_dir: Path, finish: Finish, console: Console
                 ) -> tuple[RunResults | None, bool]:
    """Run the suite for ``plan`` (one spec) into ``out_dir``; returns the finished results
    (None if pytest could not run the suite) and whether the run was interrupted."""
    import pytest

    from conformance.report.junit import indent_junit
    from conformance.report.progress import TierProgress
    from conformance.run.suite import SuiteOptions, run_suite

    sel = finish.selection
    console.print(f"specgate certify: backend {plan.backend}, spec {plan.specs[0]}, profile "
                  f"{plan.profile}, graphs {plan.graph_executor or 'off'}, device "
                  f"{plan.device}, {plan.workers} worker(s)"
                  + (f", {sel.describe()}" if sel else ""), markup=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / "junit.xml"
    with tempfile.TemporaryDirectory() as tmp:
        run = run_suite(SuiteOptions(plan, repro_dir=str(out_dir)), Path(tmp) / "results.json",
                        junit, (TierProgress(console),))
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
    return _finish(run.results, finish, junit), run.interrupted


def _known_from(plan: RunPlan) -> list[KnownFailure] | None:
    from conformance.run.known_failures import load_known
    from conformance.run.suite import suite_dir

    if plan.known_failures is None:
        return None
    try:
        return load_known(Path(plan.known_failures), suite_dir())
    except ValueError as err:
        raise UsageError(str(err)) from None


def _selection(args: argparse.Namespace) -> Selection:
    from conformance.run.only import parse_only
    from conformance.run.shard import DURATIONS, load_durations
    from conformance.run.suite import suite_dir

    try:
        only = tuple(parse_only(args.only, suite_dir()))
        if args.shard or args.durations is not None:
            load_durations(Path(args.durations or DURATIONS))
    except ValueError as err:
        raise UsageError(str(err)) from None
    if only and args.shard:
        raise UsageError("--only and --shard: rerunning single checks needs no shards")
    return Selection(only, args.keyword or None, str(args.shard) if args.shard else None)


def certify_plan(args: argparse.Namespace, selection: Selection) -> RunPlan:
    """The run ``args`` ask for, checked before any work (``build_plan``), the backend opened
    once on the model."""
    asked = RunPlan(args.backend, profile=args.profile, model=args.model,
                    draft_model=args.draft_model, device=args.device,
                    case_timeout=args.case_timeout, workers=args.workers, only=selection.only,
                    keyword=selection.keyword, shard=selection.shard, durations=args.durations,
                    known_failures=args.known_failures, strict_known=args.strict_known,
                    require=args.require)
    return build_plan(asked, args.spec, args.graphs, probe_open=True)


def _warn_unmatched(console: Console, what: str, per_cert: list[set[str]]) -> None:
    """One warning per listed id that matched no check in any certificate of the run."""
    for name in sorted(set.intersection(*per_cert) if per_cert else ()):
        console.print(f"specgate certify: warning: {what} {name}: matches no check of this run",
                      markup=False)


@dataclass
class _Specs:
    """What the runs of the plan's specs left: their certificates, whether Ctrl-C stopped them,
    whether every spec ran, and per certificate the listed ids that matched no check there."""

    certs: list[Certificate] = field(default_factory=list)
    interrupted: bool = False
    ran_all: bool = False
    unknown: list[set[str]] = field(default_factory=list)  # known-failure ids
    unmatched: list[set[str]] = field(default_factory=list)  # --only ids


def _certify_specs(plan: RunPlan, multi: bool, target: ReportDir, finish: Finish,
                   console: Console) -> _Specs:
    """Each spec of ``plan`` in turn into the staging directory, until one is interrupted or
    pytest cannot run it."""
    from conformance.report.certificate import build_certificate
    from conformance.report.markdown import write_reports

    done = _Specs()
    for name in plan.specs:
        out_dir = contained(target.staging, name) if multi else target.staging
        results, done.interrupted = _certify_one(plan.for_spec(name), out_dir, finish, console)
        if results is not None and multi and finish.selection.drops(results) \
                and not done.interrupted:
            shutil.rmtree(out_dir)  # the selection names no check of this spec
            console.print(f"specgate certify: spec {name}: no check matches "
                          f"{finish.selection.describe()}", markup=False)
            continue
        if results is not None:
            done.unmatched.append(set(finish.selection.only) - {c.nodeid for c in results.checks})
            if results.known_failures is not None:
                done.unknown.append({u.check for u in results.known_failures.unknown})
            cert = build_certificate(results)
            shown = target.target / out_dir.relative_to(target.staging)
            write_reports(cert, out_dir, shown)
            done.certs.append(cert)
            print_certificate(cert, shown)
        if done.interrupted or results is None:
            break
    else:
        done.ran_all = True
    return done


def _summarise(done: _Specs, multi: bool, target: ReportDir, finish: Finish,
               console: Console) -> None:
    """The warnings of the whole run, and for several specs their summary."""
    from conformance.report.summary import summary_markdown

    _warn_unmatched(console, "--only", done.unmatched)
    _warn_unmatched(console, "--known-failures lists", done.unknown)
    if multi and (done.certs or done.ran_all):
        (target.staging / "summary.md").write_text(summary_markdown(done.certs))
    if multi and done.certs:
        print_summary("specgate certify: every spec", done.certs, target.target / "summary.md")
    elif multi and done.ran_all:
        console.print(f"specgate certify: no check of any spec matches "
                      f"{finish.selection.describe()}", markup=False)
        done.ran_all = False


def _report_dir(path: str) -> ReportDir:
    from conformance.report.report_dir import ReportDir, ReportDirError

    try:
        return ReportDir(Path(path))
    except ReportDirError as err:
        raise UsageError(str(err)) from None


def cmd_certify(args: argparse.Namespace) -> int:
    from conformance.report.progress import stderr_console

    selection = _selection(args)
    plan = certify_plan(args, selection)
    finish = Finish(selection, _known_from(plan), str(plan.known_failures), plan.strict_known,
                    plan.require)
    target = _report_dir(args.report)
    console = stderr_console()
    if args.spec == "claimed":
        console.print("specgate certify: the backend claims " + ", ".join(plan.specs))
    multi = args.spec in MULTI_SPEC
    try:
        done = _certify_specs(plan, multi, target, finish, console)
        _summarise(done, multi, target, finish, console)
        target.commit()
    except BaseException:
        target.discard()  # the previous report stays, whole
        raise
    if done.interrupted:
        checks = sum(c.total_checks for c in done.certs)
        raise Interrupted(f"certify stopped; the certificate in {args.report} is marked "
                          f"INCOMPLETE and covers the {checks} checks that finished")
    return 0 if done.ran_all and all(c.status == "passed" for c in done.certs) else 1


def _shard(text: str) -> str:
    from conformance.run.shard import parse_shard

    try:
        return str(parse_shard(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``specgate certify``'s arguments: what runs, then which checks and how they are judged."""
    from conformance.plan.specs import SPECS

    parser.add_argument("--backend", default=os.environ.get("SPECGATE_BACKEND", "refengine"),
                        help="entry-point name (refengine, hf, ctranslate2), mutant:NAME or "
                             "module:factory; the default comes from $SPECGATE_BACKEND if set")
    parser.add_argument("--spec", default="claimed",
                        help=f"{' | '.join(SPECS)} | all | claimed (every spec the backend "
                             "claims); all and claimed write one certificate per spec")
    parser.add_argument("--profile", default="gate", choices=["gate", "full"],
                        help="gate: small prompt set, 32 tokens; full: default set, 64 tokens")
    parser.add_argument("--report", default="specgate-report",
                        help="output directory, replaced as a whole at the end of the run")
    parser.add_argument("-n", dest="workers", type=count, default=min(2, os.cpu_count() or 1),
                        help="pytest-xdist workers (0: in-process, where a backend stuck in "
                             "native code stops the run instead of failing its check)")
    parser.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    parser.add_argument("--draft-model", default=None,
                        help="override the spec configurations' draft model")
    add_graphs_argument(parser, None, "run the backend's forwards through its graph runner "
                        "with this executor (the backend must claim graph_runner): "
                        "%(choices)s; auto, or the flag alone: the device's fastest (aot on "
                        "the CPU, cuda graphs on a GPU); default: eager")
    parser.add_argument("--device", default="cpu", type=device_arg, help=DEVICE_HELP)
    parser.add_argument("--case-timeout", type=seconds, default=None, metavar="SECONDS",
                        help="each phase of a check (set-up, run, teardown) that takes longer "
                             "fails with the backend call it was in; 0: no limit; default by "
                             f"profile: {timeout_help('--graphs')}")
    _add_selection_arguments(parser)


def _add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.report.coverage import CLASS_NAMES

    parser.add_argument("--only", action="append", default=[], metavar="NODEID[,NODEID...]",
                        help="run only these checks, by node id as report.json lists them "
                             "(test_lossless.py::test_...[...]); repeatable")
    parser.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                        help="run only the checks whose names match this pytest -k expression")
    parser.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                        help="run shard I of N: a deterministic split of the checks balanced "
                             "by recorded durations; join the shards with specgate report merge")
    parser.add_argument("--durations", default=None, metavar="FILE",
                        help="the durations table --shard balances by (default: the bundled "
                             "one; record one with specgate report durations)")
    parser.add_argument("--known-failures", default=None, metavar="FILE",
                        help="TOML file of known failures (check id -> reason, optional "
                             "expiry): reported as known, not failing the gate")
    parser.add_argument("--strict-known", action="store_true",
                        help="a known failure that now passes (stale) fails the gate")
    parser.add_argument("--require", default=None, choices=CLASS_NAMES,
                        help="fail the run unless every check this coverage class needs ran "
                             "(none of them not claimed; docs/adapter.md, Coverage classes)")
