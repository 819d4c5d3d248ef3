"""The ``specgate`` command: argument parsing and dispatch. The commands themselves live with
their role: ``run/certify.py``, ``run/mutants.py``, ``checks/commands.py`` (golden, expected),
``bench/command.py``, ``report/merge.py`` and ``report/durations.py`` (``specgate report``).

Exit codes: 0 every required check passed; 1 a check failed (or the run was vacuous); 2 a usage
or configuration error, reported as one line on stderr without a traceback, before any work
starts; 130 interrupted (Ctrl-C), reported as one line.

Results go to stdout; progress and messages to stderr (``conformance.report.progress``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from conformance.bench.command import cmd_bench
from conformance.checks.commands import cmd_expected, cmd_golden
from conformance.checks.golden_scenarios import SCENARIOS
from conformance.plan.usage import INTERRUPTED, USAGE_ERROR, Interrupted, UsageError
from conformance.report.coverage import CLASS_NAMES
from conformance.report.durations import cmd_durations
from conformance.report.merge import cmd_merge
from conformance.repro.command import cmd_repro
from conformance.run.certify import cmd_certify
from conformance.run.device import DEVICE_HELP, device_arg
from conformance.run.interrupt_redelivery import keep_interrupts
from conformance.run.mutants import cmd_mutants
from conformance.run.quick_exit import exit_now
from conformance.version import specgate_version
from refengine.config import GRAPH_EXECUTORS

GRAPH_CHOICES = (*GRAPH_EXECUTORS, "auto", "none")  # --graphs: auto, none: run/device.py


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


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


def _shard(text: str) -> str:
    from conformance.run.shard import parse_shard

    try:
        return str(parse_shard(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _cmd_cache(args: argparse.Namespace) -> int:
    """``specgate cache``, imported when run: it imports torch, which ``specgate report merge``
    must not need (a CI merge job installs specgate without torch: docs/ci.md)."""
    from conformance.run.cache_command import cmd_cache

    return cmd_cache(args)


def build_parser() -> argparse.ArgumentParser:
    from conformance.plan.specs import SPECS

    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="specgate", formatter_class=fmt, description="Conformance harness "
                     "for speculative decoding, with a compact reference engine. Exit codes: "
                     "0 passed, 1 a check failed, 2 usage error, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"specgate {specgate_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True

    certify = sub.add_parser("certify", formatter_class=fmt, help="run the conformance suite "
                             "against a backend and write report.md, report.json and "
                             "junit.xml")
    certify.add_argument("--backend", default=os.environ.get("SPECGATE_BACKEND", "refengine"),
                         help="entry-point name (refengine, hf, ctranslate2), mutant:NAME or "
                              "module:factory; the default comes from $SPECGATE_BACKEND if set")
    certify.add_argument("--spec", default="claimed",
                         help=f"{' | '.join(SPECS)} | all | claimed (every spec the backend "
                              "claims); all and claimed write one certificate per spec")
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
    certify.add_argument("--graphs", nargs="?", const="auto", default=None,
                         choices=GRAPH_CHOICES, metavar="EXECUTOR",
                         help="run the backend's forwards through its graph runner with this "
                              "executor (the backend must claim graph_runner): "
                              f"{', '.join(GRAPH_CHOICES)}; auto, or the flag alone: the "
                              "device's fastest (aot on the CPU, cuda graphs on a GPU); "
                              "default: eager")
    certify.add_argument("--device", default="cpu", type=device_arg, help=DEVICE_HELP)
    certify.add_argument("--case-timeout", type=_seconds, default=None, metavar="SECONDS",
                         help="each phase of a check (set-up, run, teardown) that takes longer "
                              "fails with the backend call it was in; 0: no limit; default by "
                              "profile: gate 300, full 1200, four times that with --graphs "
                              "compiled or frozen")
    certify.add_argument("--only", action="append", default=[], metavar="NODEID[,NODEID...]",
                         help="run only these checks, by node id as report.json lists them "
                              "(test_lossless.py::test_...[...]); repeatable")
    certify.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                         help="run only the checks whose names match this pytest -k expression")
    certify.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                         help="run shard I of N: a deterministic split of the checks balanced by "
                              "recorded durations; join the shards with specgate report merge")
    certify.add_argument("--durations", default=None, metavar="FILE",
                         help="the durations table --shard balances by (default: the bundled "
                              "one; record one with specgate report durations)")
    certify.add_argument("--known-failures", default=None, metavar="FILE",
                         help="TOML file of known failures (check id -> reason, optional "
                              "expiry): reported as known, not failing the gate")
    certify.add_argument("--strict-known", action="store_true",
                         help="a known failure that now passes (stale) fails the gate")
    certify.add_argument("--require", default=None, choices=CLASS_NAMES,
                         help="fail the run unless every check this coverage class needs ran "
                              "(none of them not claimed; docs/adapter.md, Coverage classes)")
    certify.set_defaults(func=cmd_certify)

    gold = sub.add_parser("golden", formatter_class=fmt,
                          help="record or check golden acceptance traces (serial)")
    gold.add_argument("action", choices=["record", "check"])
    gold.add_argument("--spec", default="all",
                      help=f"{' | '.join(n for n in SPECS if n != 'none')} | all")
    gold.add_argument("--prompt-set", default="default", help="a set in fixtures/prompts")
    gold.add_argument("--max-new-tokens", type=_positive_int, default=128,
                      help="tokens per request of the plain trace (the chunked and session "
                           "traces: 32)")
    gold.add_argument("--trace", action="append", choices=list(SCENARIOS), default=None,
                      help="only this trace of each configuration (repeatable; default: all)")
    gold.add_argument("--model", default="tiny-code", help="fixture name or model directory")
    gold.add_argument("--draft-model", default=None,
                      help="a bundled draft fixture in place of the spec's own (one --spec): "
                           "its traces are kept under golden/<config>@<draft model>")
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
    mutants.add_argument("--device", default="cpu", type=device_arg, help=DEVICE_HELP)
    mutants.add_argument("--json", action="store_true", help="print the results as JSON")
    mutants.add_argument("--list", action="store_true",
                         help="list the zoo (name, spec, bug class, the check meant to kill "
                              "it) without running anything; with --json, as JSON")
    mutants.set_defaults(func=cmd_mutants)

    bench = sub.add_parser("bench", formatter_class=fmt,
                           help="tokens/s of backends side by side, with ratios")
    bench.add_argument("--backends", default=None,
                       help="comma-separated (unset: refengine,hf for --spec none; refengine "
                            "otherwise, compared with its own plain decoding; with a spec, "
                            "further backends decode plainly beside it)")
    bench.add_argument("--spec", default="none",
                       help=f"{' | '.join(SPECS)} | chains; eagle-v2 runs beside its V1 twins, "
                            "mtp beside EAGLE at equal N; chains: plain, EAGLE, n-gram and "
                            "draft-model chains on every backend claiming each, every (backend, "
                            "lane) in a process of its own, outputs compared")
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
                       help="override the spec configurations' draft model (--spec chains: "
                            "the EAGLE lanes' head, default tiny-code-eagle-vllm)")
    bench.add_argument("--graphs", nargs="?", const="auto", default="auto",
                       choices=GRAPH_CHOICES, metavar="EXECUTOR",
                       help="also run each lane of a backend claiming graph_runner through its "
                            "graph runner with this executor, in a lane of its own: "
                            f"{', '.join(GRAPH_CHOICES)}; auto: the device's fastest (aot on "
                            "the CPU, whose first run on a machine compiles each key for "
                            "minutes in all; cuda graphs on a GPU); none: no graph lanes")
    bench.add_argument("--device", default="cpu", type=device_arg,
                       help="where every backend runs: cpu, cuda or cuda:N; on CUDA the table "
                            "adds device time per step, capture cost and GPU memory")
    bench.set_defaults(func=cmd_bench)

    repro = sub.add_parser("repro", formatter_class=fmt, help="replay a repro file (a failing "
                           "check's scenario) against a backend; exit 1 if it diverges")
    repro.add_argument("file", help="a repro file (docs/repro.md), e.g. "
                       "<report>/repro/<check-id>.json")
    repro.add_argument("--backend", default=None,
                       help="as for certify; unset: the backend the file was recorded on, if "
                            "specgate knows it by name (a module:factory in a file is never "
                            "imported)")
    repro.add_argument("--spec", default=None,
                       help=f"{' | '.join(SPECS)}: replay every run under this spec's first "
                            "configuration instead of the recorded one")
    repro.add_argument("--emit-pytest", default=None, metavar="test_NAME.py",
                       help="write the scenario as a standalone pytest module (run it with "
                            "pytest --specgate-backend B) instead of replaying it")
    repro.set_defaults(func=cmd_repro)
    report = sub.add_parser("report", formatter_class=fmt,
                            help="work with certificates: merge shards, record durations")
    actions = report.add_subparsers(dest="action", parser_class=_Parser, metavar="ACTION")
    actions.required = True
    merge = actions.add_parser("merge", formatter_class=fmt, help="join the certificates of "
                               "certify --shard runs into one")
    merge.add_argument("dirs", nargs="+", metavar="DIR", help="the shards' report directories")
    merge.add_argument("--out", required=True, help="the merged certificate's directory "
                       "(replaced as a whole, like certify's --report)")
    merge.set_defaults(func=cmd_merge)
    durations = actions.add_parser("durations", formatter_class=fmt, help="record the table "
                                   "certify --shard balances by, from certificates")
    durations.add_argument("dirs", nargs="+", metavar="DIR", help="report directories")
    durations.add_argument("--out", required=True, help="the durations file to write")
    durations.set_defaults(func=cmd_durations)
    cache = sub.add_parser("cache", formatter_class=fmt, help="the compiled keys the reference "
                           "engine's 'aot' graph executor keeps between processes "
                           "($SPECGATE_CACHE_DIR, else the user cache directory)")
    cache.add_argument("action", choices=["info", "prune", "clear"],
                       help="info: where they are, each one's size, the total against the "
                       "budget ($SPECGATE_CACHE_MAX_GB), leftovers of killed builds and "
                       "loading markers; prune: delete what this code and torch can never "
                       "load; clear: delete everything")
    cache.set_defaults(func=_cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_interrupts()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except UsageError as err:  # one line, whatever a bad file put into the message
        print(f"specgate: error: {' '.join(str(err).splitlines())[:2000]}", file=sys.stderr)
        return USAGE_ERROR
    except Interrupted as err:
        print(f"specgate: interrupted: {err}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print("specgate: interrupted", file=sys.stderr)
        return INTERRUPTED


def console_main() -> NoReturn:
    """The ``specgate`` executable: after Ctrl-C, once the line is printed and the certificate
    kept, the process ends without the interpreter's teardown (``conformance.run.quick_exit``)."""
    code = main()
    if code == INTERRUPTED:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
