"""The ``specgate`` command.

Exit codes: 0 every required check passed; 1 a check failed (or the run was vacuous); 2 a usage
or configuration error, reported as one line on stderr without a traceback, before any work
starts; 130 interrupted (Ctrl-C), reported as one line.

Results go to stdout; progress and messages to stderr (``conformance.progress``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from conformance.interrupt_redelivery import keep_interrupts
from conformance.quick_exit import exit_now

if TYPE_CHECKING:  # the CLI imports heavy modules lazily, inside each command
    from rich.console import Console

    from conformance.adapter import Backend, SpecConfig
    from conformance.backends.mutants import Mutant
    from conformance.backends.mutants.source_patches import SourceMutant
    from conformance.report import Certificate
    from conformance.specs import SpecChoice
    from conformance.suite_run import SuiteRun

# refengine.config.GRAPH_EXECUTORS, spelled out so building the parser does not import torch
# (tests/test_cli.py keeps the two equal)
GRAPH_EXECUTORS = ("compiled", "frozen", "replay")
USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


class UsageError(Exception):
    """A bad argument or configuration: printed as one line, exit code 2."""


class Interrupted(Exception):
    """The user pressed Ctrl-C: printed as one line (what was kept), exit code 130."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


def _version() -> str:
    try:
        return version("specgate")
    except PackageNotFoundError:  # a checkout used without installing it
        return "unknown (not installed)"


def _stdout() -> Console:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 120  # a log or a pipe: wide enough that tables do not wrap
    return console


def _validate(spec: str, backends: list[str], model: str, draft_model: str | None = None
              ) -> list[Backend]:
    """Everything a command needs, checked before any work: specs, backends, model files;
    -> the backends, loaded."""
    from conformance.registry import BackendError, load_backend
    from conformance.specs import resolve_specs
    from refengine.data import resolve_model_dir
    from refengine.model.loader import check_draft_dir, check_model_dir

    try:
        drafts = {draft_model} if draft_model else {
            c.draft_model for choice in resolve_specs(spec) for c in choice.configs if c}
        loaded = [load_backend(name, launcher=True) for name in backends]
        check_model_dir(resolve_model_dir(model))
        for draft in sorted(drafts):
            check_draft_dir(resolve_model_dir(draft))
    except (BackendError, ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    return loaded


# --- certify ----------------------------------------------------------------------------------

def _pytest_problem(run: SuiteRun) -> str:
    """Why pytest could not run the suite, as pytest reported it."""
    return "\n".join(run.problems) or f"pytest exit code {run.exit_code}"


def _certify_one(args: argparse.Namespace, spec: SpecChoice, out_dir: Path,
                 console: Console) -> tuple[Certificate | None, bool]:
    """Run the suite for one spec into ``out_dir``; returns the certificate (None if pytest
    could not run the suite) and whether the run was interrupted."""
    import pytest

    from conformance.progress import TierProgress
    from conformance.report import build_certificate, indent_junit, write_reports
    from conformance.suite_run import SuiteOptions, run_suite

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
                          f"{_pytest_problem(run)}", markup=False)
        return None, run.interrupted
    cert = build_certificate(run.results)
    write_reports(cert, out_dir)
    return cert, run.interrupted


def _print_table(title: str, columns: list[str], rows: list[list[str]],
                 right: tuple[str, ...] = ()) -> None:
    """A rich table on stdout; ``right``: the columns of figures."""
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left",
                         overflow="fold")
    for row in rows:
        table.add_row(*row)
    _stdout().print(table)


def _print_certificate(cert: Certificate, where: Path) -> None:
    from conformance.report import headline

    counts = ("passed", "failed", "not claimed", "skipped")
    rows = []
    for t in cert.tiers:
        style = {"failed": "bold red", "passed": "green"}.get(t.status, "yellow")
        rows.append([t.tier, *(str(t.counts[o]) for o in counts), f"{t.seconds:.1f}",
                     f"[{style}]{t.status}[/]"])
    _print_table(f"specgate certificate for {cert.backend['name']} {cert.backend['version']}, "
                 f"spec {cert.spec}: {headline(cert)}",
                 ["tier", *counts, "seconds", "status"], rows, right=(*counts, "seconds"))
    out = _stdout()
    for t in cert.tiers:
        for why, n in t.not_run.items():
            out.print(f"  {t.tier}: {n} check(s) {why}", markup=False)
    out.print(f"reports: {where / 'report.md'}, {where / 'report.json'}, "
              f"{where / 'junit.xml'}", markup=False)


def cmd_certify(args: argparse.Namespace) -> int:
    from conformance.progress import stderr_console
    from conformance.report import summary_markdown, summary_rows
    from conformance.report_dir import ReportDir, ReportDirError
    from conformance.specs import resolve_specs

    (backend,) = _validate(args.spec, [args.backend], args.model, args.draft_model)
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
                _print_certificate(cert, target.target / out_dir.relative_to(target.staging))
            if interrupted or cert is None:
                break
        else:
            ran_all = True
        if args.spec == "all" and certs:
            (target.staging / "summary.md").write_text(summary_markdown(certs))
            _print_table("specgate certify: every spec", *summary_rows(certs))
        target.commit()
    except BaseException:
        target.discard()  # the previous report stays, whole
        raise
    if interrupted:
        checks = sum(c.total_checks for c in certs)
        raise Interrupted(f"certify stopped; the certificate in {args.report} is marked "
                          f"INCOMPLETE and covers the {checks} checks that finished")
    return 0 if ran_all and all(c.status == "passed" for c in certs) else 1


# --- mutants ----------------------------------------------------------------------------------

STRICT_CHECK_ERRORS = ("MemoryCheckError", "DoubleFreeError")  # raised inside refengine itself


def _killer(check: dict[str, object]) -> str:
    """Who killed a mutant: a suite check, or the engine's own strict check (which fires
    inside whichever check happened to run first, so that check is only where it showed)."""
    message = str(check["message"])
    for error in STRICT_CHECK_ERRORS:
        if error in message:
            return f"refengine strict check ({error}), raised during {check['nodeid']}"
    return str(check["nodeid"])


def cmd_mutants(args: argparse.Namespace) -> int:
    from conformance.backends.mutants import MUTANTS as CLASS_MUTANTS
    from conformance.backends.mutants.source_patches import SOURCE_MUTANTS
    from conformance.progress import Steps
    from conformance.suite_run import SuiteOptions, run_suite

    zoo: dict[str, Mutant | SourceMutant] = {**CLASS_MUTANTS, **SOURCE_MUTANTS}
    names = list(zoo) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown} (known: {', '.join(zoo)})")
    # every source mutant's patch must still apply, before any work
    _validate(args.spec or "none", [f"mutant:{n}" for n in names if n in SOURCE_MUTANTS],
              args.model, args.draft_model)
    rows = []
    with Steps("mutants", len(names)) as steps:
        for name in names:
            # A mutant runs under the spec where its bug is visible (a plain one under none, a
            # speculative one under eagle or eagle-v2); --spec forces one spec for all.
            spec = args.spec or zoo[name].spec
            steps.start(f"{name} (spec {spec})")
            opts = SuiteOptions(f"mutant:{name}", spec, args.profile, args.model,
                                args.draft_model, stop_at_first_failure=True)
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
                   "message": killers[0]["message"] if killers else None}
            rows.append(row)
            steps.done(status + (f" by {row['killed_by']}" if killers else ""))
            if not checks:
                steps.note(_pytest_problem(run))
    survived = [r for r in rows if r["status"] != "killed"]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(f"specgate mutants: {len(rows) - len(survived)} of {len(rows)} killed",
                     ["mutant", "spec", "bug class", "status", "killed by"],
                     [[r["mutant"], r["spec"], r["bug_class"], r["status"],
                       r["killed_by"] or "—"] for r in rows])
    return 1 if survived else 0


# --- golden -----------------------------------------------------------------------------------

def _golden_configs(spec: str) -> list[SpecConfig]:
    from conformance.specs import resolve_specs

    try:
        choices = resolve_specs(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    # Overlap configurations are held to their sequential twins' traces (golden_path).
    configs = [c for choice in choices for c in choice.configs
               if c is not None and not c.overlap]
    if not configs:
        raise UsageError(f"--spec {spec}: has no acceptance traces of its own (plain decoding "
                         "has none; overlap configurations use their sequential twins')")
    return configs


def cmd_golden(args: argparse.Namespace) -> int:
    from conformance import golden
    from conformance.progress import Steps
    from conformance.prompts import load_prompt_set
    from conformance.specs import config_id

    _validate("none", [], args.model)
    configs = _golden_configs(args.spec)
    try:
        load_prompt_set(args.prompt_set, args.model)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    failed = 0
    with Steps(f"golden {args.action}", len(configs)) as steps:
        for config in configs:
            steps.start(f"{config_id(config)} on prompt set {args.prompt_set}")
            trace = golden.record(config, args.prompt_set, args.model, args.max_new_tokens)
            path = golden.golden_path(config, args.prompt_set)
            s = trace.summary
            line = (f"{config_id(config)}: mean tau {s['mean_tau']}, per-position acceptance "
                    f"{s['per_position_acceptance']}, {s['verify_steps']} verify steps")
            if args.action == "record":
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(trace.to_json())
                print(f"{line} -> {path}", flush=True)
                steps.done(f"written, mean tau {s['mean_tau']}")
                continue
            if not path.exists():
                print(f"{config_id(config)}: MISSING {path}", flush=True)
                steps.done("MISSING")
                failed += 1
                continue
            stored = golden.GoldenTrace.from_json(path.read_text())
            diffs = [r.id for r, g in zip(trace.requests, stored.requests, strict=False)
                     if r != g]
            same = trace.to_json() == stored.to_json()
            print(f"{line}: {'matches' if same else 'DIFFERS'} {path}"
                  + (f" (requests {diffs[:5]})" if diffs else ""), flush=True)
            steps.done("matches" if same else "DIFFERS")
            failed += 0 if same else 1
    return 1 if failed else 0


# --- expected -----------------------------------------------------------------------------------

def cmd_expected(args: argparse.Namespace) -> int:
    from conformance import expected
    from refengine.data import fixture_names

    _validate("none", [], args.model)
    if args.model not in fixture_names():
        raise UsageError(f"--model {args.model}: expected outputs are recorded for bundled "
                         f"fixtures only ({', '.join(fixture_names())})")
    try:
        import transformers  # noqa: F401  (the recording is checked against it)
    except ImportError:
        raise UsageError("expected: recording is checked against transformers; install it "
                         "with: pip install 'specgate[hf]'") from None
    path = expected.expected_path(args.model)
    try:
        recorded = expected.record(args.model)
    except expected.ExpectedMismatch as err:
        print(f"specgate expected: transformers disagrees, nothing written: {err}", flush=True)
        return 1
    ties = sum(len(c.hf_near_ties) for c in recorded.continuations.values())
    line = (f"{args.model}: {len(recorded.continuations)} prompts, "
            f"{sum(len(c.tokens) for c in recorded.continuations.values())} tokens, "
            f"agree with transformers (near-ties: {ties})")
    if args.action == "record":
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, recorded.to_json())
        print(f"{line} -> {path}", flush=True)
        return 0
    if not path.exists():
        print(f"{line}: MISSING {path}", flush=True)
        return 1
    changed = expected.differences(expected.ExpectedOutputs.from_json(path.read_text()),
                                   recorded)
    verdict = ("matches" if not changed else f"DIFFERS ({len(changed)}: {'; '.join(changed[:3])})"
               f" from")
    print(f"{line}: {verdict} {path} (margins within {expected.MARGIN_TOLERANCE:g})",
          flush=True)
    return 0 if not changed else 1


# --- bench ------------------------------------------------------------------------------------

def _output_file(text: str) -> Path:
    """A file the command will write at the end: checked (and its directory created) before
    any work, so a long run never ends in an error that loses its figures."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"--json {text}: is a directory, expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as err:
        raise UsageError(f"--json {text}: cannot write there ({err.strerror or err})") from None
    return path


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)


def cmd_bench(args: argparse.Namespace) -> int:
    from conformance.bench import format_table, parse_batch_sizes, run_bench
    from conformance.progress import Steps

    backends = [b for b in (args.backends or ("refengine,hf" if args.spec == "none"
                                               else "refengine")).split(",") if b]
    loaded = _validate(args.spec, backends, args.model, args.draft_model)
    if args.graphs and not any(b.capabilities().graph_runner for b in loaded):
        raise UsageError(f"--graphs: none of {', '.join(backends)} claims graph_runner")
    json_path = _output_file(args.json) if args.json else None
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        with Steps("bench", len(batch_sizes)) as steps:
            result = run_bench(backends=backends, batch_sizes=batch_sizes,
                               max_new_tokens=args.max_new_tokens, spec=args.spec,
                               progress=steps, model=args.model, draft_model=args.draft_model,
                               min_requests=args.min_requests, repeats=args.repeats,
                               graphs=args.graphs)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(format_table(result))
    if json_path is not None:
        from dataclasses import asdict
        _write_atomically(json_path, json.dumps(asdict(result), indent=1) + "\n")
    return 0


# --- parser -----------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from conformance.specs import SPECS

    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="specgate", formatter_class=fmt, description="Conformance harness "
                     "for speculative decoding, with a compact reference engine. Exit codes: "
                     "0 passed, 1 a check failed, 2 usage error, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"specgate {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True

    certify = sub.add_parser("certify", formatter_class=fmt, help="run the conformance suite "
                             "against a backend and write report.md, report.json and "
                             "junit.xml")
    certify.add_argument("--backend", default=os.environ.get("SPECGATE_BACKEND", "refengine"),
                         help="entry-point name (refengine, hf, ctranslate2), mutant:NAME or "
                              "module:factory; the default comes from $SPECGATE_BACKEND if set")
    certify.add_argument("--spec", default="none",
                         help=f"{' | '.join(SPECS)} | all (one certificate per spec)")
    certify.add_argument("--profile", default="gate", choices=["gate", "full"],
                         help="gate: small prompt set, 32 tokens; full: default set, 64 tokens")
    certify.add_argument("--report", default="specgate-report",
                         help="output directory, replaced as a whole at the end of the run")
    certify.add_argument("-n", dest="workers", type=_positive_int,
                         default=min(2, os.cpu_count() or 1),
                         help="pytest-xdist workers (0: in-process, where a backend stuck in "
                              "native code stops the run instead of failing its check)")
    certify.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    certify.add_argument("--draft-model", default=None,
                         help="override the spec configurations' draft model")
    certify.add_argument("--graphs", default=None, choices=GRAPH_EXECUTORS,
                         help="run the backend's forwards through its graph runner with this "
                              "executor (the backend must claim graph_runner); default: eager")
    certify.add_argument("--case-timeout", type=_seconds, default=None, metavar="SECONDS",
                         help="each phase of a check (set-up, run, teardown) that takes longer "
                              "fails with the backend call it was in; 0: no limit; default by "
                              "profile: gate 300, full 1200, four times that with --graphs "
                              "compiled or frozen")
    certify.set_defaults(func=cmd_certify)

    gold = sub.add_parser("golden", formatter_class=fmt,
                          help="record or check golden acceptance traces (serial)")
    gold.add_argument("action", choices=["record", "check"])
    gold.add_argument("--spec", default="all",
                      help=f"{' | '.join(n for n in SPECS if n != 'none')} | all")
    gold.add_argument("--prompt-set", default="default", help="a set in fixtures/prompts")
    gold.add_argument("--max-new-tokens", type=_positive_int, default=128,
                      help="tokens per request")
    gold.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    gold.set_defaults(func=cmd_golden)

    expect = sub.add_parser("expected", formatter_class=fmt,
                            help="record or check the committed expected outputs the oracle "
                                 "answers from (checked against transformers)")
    expect.add_argument("action", choices=["record", "check"])
    expect.add_argument("--model", default="tiny-code", help="a bundled fixture")
    expect.set_defaults(func=cmd_expected)

    mutants = sub.add_parser("mutants", formatter_class=fmt, help="run the suite against every "
                             "bug-zoo mutant; exit 1 if any survives")
    mutants.add_argument("--spec", default=None,
                         help="force one spec for every mutant (unset: each mutant's own, "
                              "where its bug is visible)")
    mutants.add_argument("--draft-model", default=None, help=argparse.SUPPRESS)
    mutants.add_argument("--profile", default="gate", choices=["gate", "full"],
                         help="as for certify")
    mutants.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    mutants.add_argument("--only", default="", help="comma-separated mutant names (unset: all)")
    mutants.add_argument("--json", action="store_true", help="print the results as JSON")
    mutants.set_defaults(func=cmd_mutants)

    bench = sub.add_parser("bench", formatter_class=fmt,
                           help="tokens/s of backends side by side, with ratios")
    bench.add_argument("--backends", default=None,
                       help="comma-separated (unset: refengine,hf for --spec none; refengine "
                            "otherwise, compared with its own plain decoding; with a spec, "
                            "further backends decode plainly beside it)")
    bench.add_argument("--spec", default="none",
                       help=f"{' | '.join(SPECS)}; eagle-v2 runs beside its V1 twins, mtp "
                            "beside EAGLE at equal N")
    bench.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=64,
                       help="tokens per request")
    bench.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    bench.add_argument("--min-requests", type=_positive_int, default=8,
                       help="requests per batch size at least: batch b runs ceil(n/b) groups")
    bench.add_argument("--repeats", type=_positive_int, default=1,
                       help="run every group this many times per lane and keep the fastest")
    bench.add_argument("--json", default=None,
                       help="also write the figures to this file (its directory is created)")
    bench.add_argument("--draft-model", default=None,
                       help="override the spec configurations' draft model")
    bench.add_argument("--graphs", default=None, choices=GRAPH_EXECUTORS,
                       help="also run each lane of a backend claiming graph_runner through its "
                            "graph runner with this executor, in a lane of its own")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_interrupts()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except UsageError as err:
        print(f"specgate: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except Interrupted as err:
        print(f"specgate: interrupted: {err}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("specgate: interrupted", file=sys.stderr)
        return INTERRUPTED


def console_main() -> NoReturn:
    """The ``specgate`` executable: after Ctrl-C, once the line is printed and the certificate
    kept, the process ends without the interpreter's teardown (``conformance.quick_exit``)."""
    code = main()
    if code == INTERRUPTED:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
