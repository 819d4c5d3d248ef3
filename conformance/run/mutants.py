"""``specgate mutants``: the suite against each bug-zoo mutant; each must be killed."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from conformance.plan.device import DEVICE_HELP, device_arg
from conformance.plan.run_plan import RunPlan, build_plan
from conformance.plan.usage import Interrupted, UsageError
from conformance.report.console import print_table
from conformance.run.certify import pytest_problem

if TYPE_CHECKING:
    from conformance.backends.mutants import Mutant
    from conformance.backends.mutants.source_patches import SourceMutant
    from conformance.report.results import CheckRow


STRICT_CHECK_ERRORS = ("MemoryCheckError", "DoubleFreeError")  # raised inside refengine itself


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default=None,
                        help="force one spec for every mutant (unset: each mutant's own, "
                             "where its bug is visible)")
    parser.add_argument("--draft-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="gate", choices=["gate", "full"],
                        help="as for certify")
    parser.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    parser.add_argument("--only", default="", help="comma-separated mutant names (unset: all)")
    parser.add_argument("--device", default="cpu", type=device_arg, help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--list", action="store_true",
                        help="list the zoo (name, spec, bug class, the check meant to kill "
                             "it) without running anything; with --json, as JSON")


def _killer(check: CheckRow) -> str:
    """Who killed a mutant: a suite check, or the engine's own strict check (which fires
    inside whichever check happened to run first, so that check is only where it showed)."""
    for error in STRICT_CHECK_ERRORS:
        if error in check.message:
            return f"refengine strict check ({error}), raised during {check.nodeid}"
    return check.nodeid


def list_zoo(zoo: dict[str, Mutant | SourceMutant], names: list[str], as_json: bool) -> int:
    """``mutants --list``: each mutant's spec, bug class and the check meant to kill it, with
    the command that runs it; nothing is run."""
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown} (known: {', '.join(zoo)})")
    rows = [{"mutant": n, "spec": zoo[n].spec, "bug_class": zoo[n].bug_class,
             "meant_for": zoo[n].killed_by,
             "command": f"specgate certify --backend mutant:{n} --spec {zoo[n].spec}"}
            for n in names]
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(f"specgate mutants: the zoo, {len(rows)} mutants",
                    ["mutant", "spec", "bug class", "meant to be killed by"],
                    [[escape(str(c)) for c in (r["mutant"], r["spec"], r["bug_class"],
                                              r["meant_for"] or "—")] for r in rows])
    return 0


def _mutant_plans(args: argparse.Namespace, zoo: dict[str, Mutant | SourceMutant],
                  names: list[str]) -> list[RunPlan]:
    """Each mutant's run, checked before any work (a source mutant's patch must still apply).
    A mutant runs under the spec where its bug is visible (a plain one under none, a
    speculative one under eagle or eagle-v2); --spec forces one spec for all."""
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown} (known: {', '.join(zoo)})")
    return [build_plan(RunPlan(f"mutant:{name}", profile=args.profile, model=args.model,
                               draft_model=args.draft_model, device=args.device),
                       args.spec or zoo[name].spec, None) for name in names]


def cmd_mutants(args: argparse.Namespace) -> int:
    from conformance.backends.mutants import MUTANTS as CLASS_MUTANTS
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS
    from conformance.report.progress import Steps
    from conformance.run.suite import SuiteOptions, run_suite

    zoo: dict[str, Mutant | SourceMutant] = {**CLASS_MUTANTS, **SOURCE_MUTANTS}
    names = list(zoo) if not args.only else args.only.split(",")
    if args.list:
        return list_zoo(zoo, names, args.json)
    plans = _mutant_plans(args, zoo, names)
    rows = []
    with Steps("mutants", len(names)) as steps:
        for name, plan in zip(names, plans, strict=True):
            spec = plan.specs[0]
            steps.start(f"{name} (spec {spec})")
            with tempfile.TemporaryDirectory() as tmp:
                run = run_suite(SuiteOptions(plan, stop_at_first_failure=True),
                                Path(tmp) / "results.json")
            if run.interrupted:
                raise Interrupted(f"mutants stopped during {name}; {len(rows)} of {len(names)} "
                                  "had finished, no verdicts are reported")
            checks = run.results.checks if run.results else ()
            killers = [c for c in checks if c.outcome == "failed"]
            status = ("killed" if killers else "survived" if checks
                      else "error: the suite did not run")
            row = {"mutant": name, "spec": spec, "bug_class": zoo[name].bug_class,
                   "status": status, "killed_by": _killer(killers[0]) if killers else None,
                   "message": killers[0].message if killers else None,
                   # the check meant to kill it (tests/test_zoo_killers.py runs that one alone)
                   "meant_for": zoo[name].killed_by}
            rows.append(row)
            steps.done(status + (f" by {row['killed_by']}" if killers else ""))
            if not checks:
                steps.note(pytest_problem(run))
    survived = [r for r in rows if r["status"] != "killed"]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(f"specgate mutants: {len(rows) - len(survived)} of {len(rows)} killed",
                     ["mutant", "spec", "bug class", "status", "killed first by",
                      "meant for"],
                     [[escape(str(c)) for c in (r["mutant"], r["spec"], r["bug_class"],
                                                r["status"], r["killed_by"] or "—",
                                                r["meant_for"] or "—")] for r in rows])
    return 1 if survived else 0
