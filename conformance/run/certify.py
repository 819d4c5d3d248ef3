"""``specgate certify``: run the suite for each spec into the report directory.

``--spec claimed`` (the default) certifies every spec the backend claims (its algorithm, and
the tree and overlap capabilities the spec needs), one certificate per spec as ``--spec all``
does. The results of each spec's run are finished here before they become its certificate:
the specgate version and shard are recorded, and the known-failures file is applied
(``conformance.run.known_failures``), its known failures marked in junit.xml too.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from conformance.contract import OpenConfig
from conformance.contract.versions import ContractRefusal, config_for, declared_version
from conformance.plan.preflight import validate
from conformance.plan.usage import Interrupted, UsageError
from conformance.report.console import print_certificate, print_summary
from specwire.untrusted import contained

if TYPE_CHECKING:
    from rich.console import Console

    from conformance.contract import Backend, Capabilities
    from conformance.plan.specs import SpecChoice
    from conformance.report.certificate import Certificate
    from conformance.run.known_failures import KnownFailure
    from conformance.run.suite import SuiteRun

MULTI_SPEC = ("all", "claimed")  # one certificate per spec, in <report>/<spec>/


def pytest_problem(run: SuiteRun) -> str:
    """Why pytest could not run the suite, as pytest reported it."""
    return "\n".join(run.problems) or f"pytest exit code {run.exit_code}"


def claimed_specs(caps: Capabilities) -> list[SpecChoice]:
    """The specs a backend claims: their algorithm, and tree and overlap where they need it."""
    from conformance.plan.specs import SPECS

    return [s for s in SPECS.values() if caps.claims(f"algorithm:{s.algorithm}")
            and (caps.tree or not s.needs_tree) and (caps.overlap or not s.needs_overlap)]


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

    def drops(self, results: dict[str, object]) -> bool:
        """A spec in which ``--only``/``-k`` name no check gets no certificate of its own under
        ``--spec all|claimed``; a shard keeps it (vacuous), so every shard holds every spec and
        ``report merge`` decides over the union."""
        return bool(self.by_name and not self.shard and not results["checks"])


@dataclass(frozen=True)
class Finish:
    """What turns one spec's results into its certificate."""

    selection: Selection
    known: list[KnownFailure] | None
    known_file: str
    strict_known: bool
    require: str | None = None  # --require: a coverage class the run must meet


def _finish(results: dict[str, object], finish: Finish, junit: Path) -> dict[str, object]:
    from conformance.report.junit import mark_incomplete, mark_known
    from conformance.report.verdict import KNOWN_FAILURE
    from conformance.run.known_failures import apply_known
    from conformance.version import specgate_version

    results = {**results, "specgate_version": specgate_version(),
               "shard": finish.selection.shard, "selection": finish.selection.by_name,
               "require": finish.require}
    sel = finish.selection
    if sel and results.get("vacuous") == "zero checks collected":
        results["vacuous"] = f"zero checks collected: no check matches {sel.describe()}"
    if results.get("interrupted"):
        collected = results.get("collected") or {}
        mark_incomplete(junit, len(results["checks"]),  # type: ignore[arg-type]
                        sum(collected.values()))  # type: ignore[attr-defined]
    if finish.known is not None:
        results = apply_known(results, finish.known, finish.known_file, finish.strict_known,
                              date.today())
        mark_known(junit, {str(c["nodeid"]): str(c["known_reason"])
                           for c in results["checks"]  # type: ignore[attr-defined]
                           if c["outcome"] == KNOWN_FAILURE})
    return results


def _certify_one(args: argparse.Namespace, spec: SpecChoice, out_dir: Path, finish: Finish,
                 console: Console) -> tuple[dict[str, object] | None, bool]:
    """Run the suite for one spec into ``out_dir``; returns the finished results (None if pytest
    could not run the suite) and whether the run was interrupted."""
    import pytest

    from conformance.report.certificate import indent_junit
    from conformance.report.progress import TierProgress
    from conformance.run.suite import SuiteOptions, run_suite

    sel = finish.selection
    console.print(f"specgate certify: backend {args.backend}, spec {spec.name}, profile "
                  f"{args.profile}, graphs {args.graphs or 'off'}, device {args.device}, "
                  f"{args.workers} worker(s)"
                  + (f", {sel.describe()}" if sel else ""), markup=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / "junit.xml"
    opts = SuiteOptions(args.backend, spec.name, args.profile, args.model, args.draft_model,
                        workers=args.workers, graphs=args.graphs, device=args.device,
                        case_timeout=args.case_timeout, only=sel.only, keyword=sel.keyword,
                        shard=sel.shard, durations=args.durations,
                        repro_dir=str(out_dir))
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
    return _finish(run.results, finish, junit), run.interrupted


def _known_from(args: argparse.Namespace) -> list[KnownFailure] | None:
    from conformance.run.known_failures import load_known
    from conformance.run.suite import suite_dir

    if args.known_failures is None:
        if args.strict_known:
            raise UsageError("--strict-known needs --known-failures FILE")
        return None
    try:
        return load_known(Path(args.known_failures), suite_dir())
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


def _warn_unmatched(console: Console, what: str, per_cert: list[set[str]]) -> None:
    """One warning per listed id that matched no check in any certificate of the run."""
    for name in sorted(set.intersection(*per_cert) if per_cert else ()):
        console.print(f"specgate certify: warning: {what} {name}: matches no check of this run",
                      markup=False)


def refuses_model(backend: Backend, cfg: OpenConfig) -> None:
    """Open ``backend`` once on the model with every other setting at its default, before any
    check runs: a model specgate's own checks accept and the backend does not (vLLM refusing an
    architecture, weights its loader cannot read) is then one line and exit 2, not every check
    failing with the same line. The contract lets ``open`` refuse only with ``ValueError``;
    anything else raised here is left for the suite, whose checks report it as the failure it
    is. Mutants are the reference engine, whose loader ``validate`` already ran."""
    try:
        handle = backend.open(cfg)
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: backend {backend.name!r} refuses it: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                         ) from None
    except Exception:  # reported by the suite's checks, with their context
        return
    handle.close()


def cmd_certify(args: argparse.Namespace) -> int:
    from conformance.plan.specs import resolve_specs
    from conformance.report.certificate import (
        build_certificate,
        summary_markdown,
        write_reports,
    )
    from conformance.report.progress import stderr_console
    from conformance.report.report_dir import ReportDir, ReportDirError
    from conformance.run.device import best_graphs, device_problem

    multi = args.spec in MULTI_SPEC
    args.graphs = best_graphs(args.graphs, args.device)
    problem = device_problem(args.device, args.graphs)
    if problem:
        raise UsageError(problem)
    (backend,) = validate("all" if args.spec == "claimed" else args.spec, [args.backend],
                          args.model, args.draft_model)
    if args.graphs and not backend.capabilities().graph_runner:
        raise UsageError(f"--graphs: backend {args.backend!r} does not claim graph_runner")
    try:  # what the backend's contract version cannot express, before any work
        probe = config_for(OpenConfig(model=args.model, device=args.device),
                           declared_version(backend), backend.name)
    except ContractRefusal as err:
        raise UsageError(str(err)) from None
    if not args.backend.startswith("mutant:"):
        refuses_model(backend, probe)
    finish = Finish(_selection(args), _known_from(args), str(args.known_failures),
                    args.strict_known, args.require)
    specs = (claimed_specs(backend.capabilities()) if args.spec == "claimed"
             else resolve_specs(args.spec))
    if not specs:
        raise UsageError(f"--spec claimed: backend {args.backend!r} claims no spec "
                         f"(algorithms: {sorted(backend.capabilities().algorithms)})")
    try:
        target = ReportDir(Path(args.report))
    except ReportDirError as err:
        raise UsageError(str(err)) from None
    console = stderr_console()
    if args.spec == "claimed":
        console.print("specgate certify: the backend claims " + ", ".join(s.name for s in specs))
    certs: list[Certificate] = []
    interrupted = ran_all = False
    unknown: list[set[str]] = []   # per certificate: known-failure ids of no check there
    unmatched: list[set[str]] = []  # per certificate: --only ids of no check there
    try:
        for spec in specs:
            out_dir = contained(target.staging, spec.name) if multi else target.staging
            results, interrupted = _certify_one(args, spec, out_dir, finish, console)
            if results is not None and multi and finish.selection.drops(results) \
                    and not interrupted:
                shutil.rmtree(out_dir)  # the selection names no check of this spec
                console.print(f"specgate certify: spec {spec.name}: no check matches "
                              f"{finish.selection.describe()}", markup=False)
                continue
            if results is not None:
                ran = {str(c["nodeid"]) for c in results["checks"]}  # type: ignore[attr-defined]
                unmatched.append(set(finish.selection.only) - ran)
                if finish.known is not None:
                    unknown.append({str(u["check"]) for u in
                                    results["known_failures"]["unknown"]})  # type: ignore[index]
                cert = build_certificate(results)
                shown = target.target / out_dir.relative_to(target.staging)
                write_reports(cert, out_dir, shown)
                certs.append(cert)
                print_certificate(cert, shown)
            if interrupted or results is None:
                break
        else:
            ran_all = True
        _warn_unmatched(console, "--only", unmatched)
        _warn_unmatched(console, "--known-failures lists", unknown)
        if multi and (certs or ran_all):
            (target.staging / "summary.md").write_text(summary_markdown(certs))
        if multi and certs:
            print_summary("specgate certify: every spec", certs, target.target / "summary.md")
        elif multi and ran_all:
            console.print(f"specgate certify: no check of any spec matches "
                          f"{finish.selection.describe()}", markup=False)
            ran_all = False
        target.commit()
    except BaseException:
        target.discard()  # the previous report stays, whole
        raise
    if interrupted:
        checks = sum(c.total_checks for c in certs)
        raise Interrupted(f"certify stopped; the certificate in {args.report} is marked "
                          f"INCOMPLETE and covers the {checks} checks that finished")
    return 0 if ran_all and all(c.status == "passed" for c in certs) else 1
