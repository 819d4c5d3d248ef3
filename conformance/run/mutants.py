"""``specgate mutants``: the suite against each bug-zoo mutant; each must be killed."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from conformance.plan.preflight import validate
from conformance.plan.usage import Interrupted, UsageError
from conformance.report.console import print_table
from conformance.run.certify import pytest_problem

if TYPE_CHECKING:
    from conformance.backends.mutants import Mutant
    from conformance.backends.mutants.source_patches import SourceMutant


STRICT_CHECK_ERRORS = ("MemoryCheckError", "DoubleFreeError")  # raised inside refengine itself


def _killer(check: dict[str, object]) -> str:
    """Who killed a mutant: a suite check, or the engine's own strict check (which fires
    inside whichever check happened to run first, so that check is only where it showed)."""
    message = str(check["message"])
    for error in STRICT_CHECK_ERRORS:
        if error in message:
            return f"refengine strict check ({error}), raised during {check['nodeid']}"
    return str(check["nodeid"])


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


def cmd_mutants(args: argparse.Namespace) -> int:
    from conformance.backends.mutants import MUTANTS as CLASS_MUTANTS
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS
    from conformance.report.progress import Steps
    from conformance.run.suite import SuiteOptions, run_suite

    zoo: dict[str, Mutant | SourceMutant] = {**CLASS_MUTANTS, **SOURCE_MUTANTS}
    names = list(zoo) if not args.only else args.only.split(",")
    if args.list:
        return list_zoo(zoo, names, args.json)
    from conformance.run.device import device_problem

    problem = device_problem(args.device, None)
    if problem:
        raise UsageError(problem)
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown} (known: {', '.join(zoo)})")
    # every source mutant's patch must still apply, before any work
    validate(args.spec or "none", [f"mutant:{n}" for n in names if n in SOURCE_MUTANTS],
              args.model, args.draft_model)
    rows = []
    with Steps("mutants", len(names)) as steps:
        for name in names:
            # A mutant runs under the spec where its bug is visible (a plain one under none, a
            # speculative one under eagle or eagle-v2); --spec forces one spec for all.
            spec = args.spec or zoo[name].spec
            steps.start(f"{name} (spec {spec})")
            opts = SuiteOptions(f"mutant:{name}", spec, args.profile, args.model,
                                args.draft_model, device=args.device,
                                stop_at_first_failure=True)
            with tempfile.TemporaryDirectory() as tmp:
                run = run_suite(opts, Path(tmp) / "results.json")
            if run.interrupted:
                raise Interrupted(f"mutants stopped during {name}; {len(rows)} of {len(names)} "
                                  "had finished, no verdicts are reported")
            checks = run.results["checks"] if run.results else []
            killers = [c for c in checks if c["outcome"] == "failed"]
            status = ("killed" if killers else "survived" if checks
                      else "error: the suite did not run")
            row = {"mutant": name, "spec": spec, "bug_class": zoo[name].bug_class,
                   "status": status, "killed_by": _killer(killers[0]) if killers else None,
                   "message": killers[0]["message"] if killers else None,
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
