"""The ``specgate`` command.

Exit codes: 0 every required check passed; 1 a check failed (or the run was vacuous); 2 a usage
or configuration error, reported as one line on stderr without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports heavy modules lazily, inside each command
    from conformance.adapter import SpecConfig

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad argument or configuration: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- certify ----------------------------------------------------------------------------------

def _suite_dir() -> Path:
    import conformance.suites
    return Path(conformance.suites.__file__).resolve().parent


def _plugin_args() -> list[str]:
    """Load the plugin explicitly only when no installed entry point does it already."""
    installed = any(ep.name == "specgate" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.plugin"]


def _validate(spec: str, backends: list[str], model: str, draft_model: str | None = None) -> None:
    from conformance.registry import BackendError, load_backend
    from conformance.specs import resolve_specs
    from refengine.data import resolve_model_dir
    from refengine.model.loader import check_model_dir

    try:
        drafts = {draft_model} if draft_model else {
            c.draft_model for choice in resolve_specs(spec) for c in choice.configs if c}
        for name in backends:
            load_backend(name)
        check_model_dir(resolve_model_dir(model))
        for draft in drafts:
            resolve_model_dir(draft)
    except (BackendError, ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None


def cmd_certify(args: argparse.Namespace) -> int:
    import pytest

    from conformance.report import build_certificate, tier_table, write_reports
    from conformance.specs import resolve_specs

    _validate(args.spec, [args.backend], args.model, args.draft_model)
    report_dir = Path(args.report)
    report_dir.mkdir(parents=True, exist_ok=True)
    worst = 0
    for spec in resolve_specs(args.spec):
        _progress(f"specgate certify: backend {args.backend}, spec {spec.name}, "
                  f"profile {args.profile}, {args.workers} worker(s)")
        out_dir = report_dir if args.spec != "all" else report_dir / spec.name
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            results = Path(tmp) / "results.json"
            pytest_args = [
                str(_suite_dir()), "-c", os.devnull, "--rootdir", str(_suite_dir()),
                "-p", "no:cacheprovider", *_plugin_args(),
                "--specgate-backend", args.backend, "--specgate-spec", spec.name,
                "--specgate-profile", args.profile, "--specgate-model", args.model,
                "--specgate-results", str(results), "--junitxml", str(out_dir / "junit.xml"),
                *(["--specgate-draft-model", args.draft_model] if args.draft_model else []),
                "-q", "-W", "ignore::DeprecationWarning",
            ]
            if args.workers > 1:
                pytest_args += ["-n", str(args.workers)]
            code = pytest.main(pytest_args)
            if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERRUPTED):
                raise UsageError(f"pytest stopped with exit code {int(code)}")
            if not results.exists():
                _progress("specgate certify: the suite produced no results")
                return 1
            cert = build_certificate(json.loads(results.read_text()))
        write_reports(cert, out_dir)
        print(f"\nspecgate certificate for {cert.backend['name']} {cert.backend['version']}, "
              f"spec {cert.spec}: {cert.status.upper()}\n")
        print(tier_table(cert))
        print(f"\nreports: {out_dir / 'report.md'}, {out_dir / 'report.json'}, "
              f"{out_dir / 'junit.xml'}")
        worst = max(worst, 0 if cert.status == "passed" else 1)
    return worst


# --- mutants ----------------------------------------------------------------------------------

def _run_suite_quietly(backend: str, spec: str, profile: str, model: str, results: Path,
                       stop_at_first_failure: bool, draft_model: str | None = None) -> None:
    import pytest

    args = [str(_suite_dir()), "-c", os.devnull, "--rootdir", str(_suite_dir()),
            "-p", "no:cacheprovider", *_plugin_args(), "--specgate-backend", backend,
            "--specgate-spec", spec, "--specgate-profile", profile, "--specgate-model", model,
            "--specgate-results", str(results), "-qq", "--tb=no", "--no-header",
            "-W", "ignore::DeprecationWarning"]
    if stop_at_first_failure:
        args.append("-x")
    if draft_model:
        args += ["--specgate-draft-model", draft_model]
    # The verdict comes from the results file; pytest's own report would bury the table.
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(args)


def cmd_mutants(args: argparse.Namespace) -> int:
    from conformance.backends.mutants import MUTANTS

    _validate(args.spec or "none", [], args.model, args.draft_model)
    names = list(MUTANTS) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown} (known: {', '.join(MUTANTS)})")
    rows = []
    for i, name in enumerate(names, 1):
        # A speculative mutant is only visible under speculation: by default it runs with the
        # chain spec, a plain one with none; --spec forces one spec for all.
        spec = args.spec or ("eagle" if MUTANTS[name].requires_spec else "none")
        _progress(f"[{i}/{len(names)}] mutant {name} (spec {spec}): running the suite ...")
        with tempfile.TemporaryDirectory() as tmp:
            results = Path(tmp) / "results.json"
            _run_suite_quietly(f"mutant:{name}", spec, args.profile, args.model, results,
                               stop_at_first_failure=True, draft_model=args.draft_model)
            checks = json.loads(results.read_text())["checks"] if results.exists() else []
        killers = [c for c in checks if c["outcome"] == "failed"]
        status = "killed" if killers else "survived" if checks else "error: the suite did not run"
        row = {"mutant": name, "spec": spec, "bug_class": MUTANTS[name].bug_class,
               "status": status,
               "killed_by": killers[0]["nodeid"] if killers else None,
               "message": killers[0]["message"] if killers else None}
        rows.append(row)
        _progress(f"    {row['status']}" + (f" by {row['killed_by']}" if killers else ""))
    survived = [r for r in rows if r["status"] != "killed"]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| mutant | spec | bug class | status | killed by |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mutant']} | {r['spec']} | {r['bug_class']} | {r['status']} | "
                  f"{r['killed_by'] or '—'} |")
        print(f"\n{len(rows) - len(survived)} of {len(rows)} mutants killed")
    if any(r["status"].startswith("error") for r in rows):
        _progress("specgate mutants: the suite failed to run for some mutants (see above)")
    return 1 if survived else 0


# --- golden -----------------------------------------------------------------------------------

def _golden_configs(spec: str) -> list[SpecConfig]:
    from conformance.specs import resolve_specs

    try:
        choices = resolve_specs(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    configs = [c for choice in choices for c in choice.configs if c is not None]
    if not configs:
        raise UsageError(f"--spec {spec}: plain decoding has no acceptance traces")
    return configs


def cmd_golden(args: argparse.Namespace) -> int:
    from conformance import golden
    from conformance.specs import config_id

    _validate("none", [], args.model)
    configs = _golden_configs(args.spec)
    failed = 0
    for i, config in enumerate(configs, 1):
        _progress(f"[{i}/{len(configs)}] {config_id(config)} on prompt set {args.prompt_set} ...")
        try:
            trace = golden.record(config, args.prompt_set, args.model, args.max_new_tokens)
        except FileNotFoundError as err:
            raise UsageError(str(err)) from None
        path = golden.golden_path(config, args.prompt_set)
        s = trace.summary
        line = (f"{config_id(config)}: mean tau {s['mean_tau']}, per-position acceptance "
                f"{s['per_position_acceptance']}, {s['verify_steps']} verify steps")
        if args.action == "record":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(trace.to_json())
            print(f"{line} -> {path}")
            continue
        if not path.exists():
            print(f"{config_id(config)}: MISSING {path}")
            failed += 1
            continue
        stored = golden.GoldenTrace.from_json(path.read_text())
        diffs = [r.id for r, g in zip(trace.requests, stored.requests, strict=False) if r != g]
        same = trace.to_json() == stored.to_json()
        print(f"{line}: {'matches' if same else 'DIFFERS'} {path}"
              + (f" (requests {diffs[:5]})" if diffs else ""))
        failed += 0 if same else 1
    return 1 if failed else 0


# --- bench ------------------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    from conformance.bench import format_table, parse_batch_sizes, run_bench

    backends = [b for b in (args.backends or ("refengine,hf" if args.spec == "none"
                                               else "refengine")).split(",") if b]
    _validate(args.spec, backends, args.model, args.draft_model)
    try:
        result = run_bench(backends=backends, batch_sizes=parse_batch_sizes(args.batch_sizes),
                           max_new_tokens=args.max_new_tokens, spec=args.spec,
                           progress=_progress, model=args.model, draft_model=args.draft_model,
                           min_requests=args.min_requests, repeats=args.repeats)
    except (ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    print(format_table(result))
    if args.json:
        from dataclasses import asdict
        Path(args.json).write_text(json.dumps(asdict(result), indent=1) + "\n")
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specgate", description="Conformance harness for speculative "
                     "decoding, with a compact reference engine.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True

    certify = sub.add_parser("certify", help="run the conformance suite against a backend and "
                             "write report.md, report.json and junit.xml")
    certify.add_argument("--backend", default=os.environ.get("SPECGATE_BACKEND", "refengine"),
                         help="entry-point name (refengine, hf) or module:factory")
    certify.add_argument("--spec", default="none",
                         help="none | eagle | eagle-tree | all (default: none)")
    certify.add_argument("--profile", default="gate", choices=["gate", "full"])
    certify.add_argument("--report", default="specgate-report", help="output directory")
    certify.add_argument("-n", dest="workers", type=_positive_int,
                         default=min(2, os.cpu_count() or 1),
                         help="pytest-xdist workers (0 or 1: in-process)")
    certify.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    certify.add_argument("--draft-model", default=None,
                         help="override the spec configurations' draft model")
    certify.set_defaults(func=cmd_certify)

    gold = sub.add_parser("golden", help="record or check golden acceptance traces (serial)")
    gold.add_argument("action", choices=["record", "check"])
    gold.add_argument("--spec", default="all", help="eagle | eagle-tree | all")
    gold.add_argument("--prompt-set", default="default")
    gold.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gold.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    gold.set_defaults(func=cmd_golden)

    mutants = sub.add_parser("mutants", help="run the suite against every bug-zoo mutant; "
                             "exit 1 if any survives")
    mutants.add_argument("--spec", default=None,
                         help="force one spec for every mutant (default: eagle for speculative "
                              "mutants, none for plain ones)")
    mutants.add_argument("--draft-model", default=None, help=argparse.SUPPRESS)
    mutants.add_argument("--profile", default="gate", choices=["gate", "full"])
    mutants.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    mutants.add_argument("--only", default="", help="comma-separated mutant names")
    mutants.add_argument("--json", action="store_true", help="print the results as JSON")
    mutants.set_defaults(func=cmd_mutants)

    bench = sub.add_parser("bench", help="tokens/s of backends side by side, with ratios")
    bench.add_argument("--backends", default=None,
                       help="comma-separated (default: refengine,hf for --spec none; refengine "
                            "otherwise, compared with its own plain decoding)")
    bench.add_argument("--spec", default="none")
    bench.add_argument("--batch-sizes", default="1,8,32")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=64)
    bench.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    bench.add_argument("--min-requests", type=_positive_int, default=8,
                       help="requests per batch size at least: batch b runs ceil(n/b) groups")
    bench.add_argument("--repeats", type=_positive_int, default=1,
                       help="run every group this many times per lane and keep the fastest")
    bench.add_argument("--json", default=None, help="also write the figures here")
    bench.add_argument("--draft-model", default=None,
                       help="override the spec configurations' draft model")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except UsageError as err:
        print(f"specgate: error: {err}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
