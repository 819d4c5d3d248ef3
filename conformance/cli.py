"""The ``specgate`` command: argument parsing and dispatch. The commands themselves live with
their role, each module with its own ``add_arguments``: ``run/certify.py``, ``run/mutants.py``,
``checks/commands.py`` (golden, expected), ``bench/command.py``, ``repro/command.py``,
``report/merge.py`` and ``report/durations.py`` (``specgate report``), ``run/cache_command.py``.

A command's module is imported only when that command runs or its ``--help`` is asked for (the
parse has two stages: the command's name, then its arguments), so ``specgate --help`` and
``specgate --version`` import neither torch nor the engine, and a command imports only what it
needs (``specgate report merge`` runs where torch is not installed: docs/ci.md).

Exit codes: 0 every required check passed; 1 a check failed (or the run was vacuous); 2 a usage
or configuration error, reported as one line on stderr without a traceback, before any work
starts; 130 interrupted (Ctrl-C), reported as one line.

Results go to stdout; progress and messages to stderr (``conformance.report.progress``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NoReturn

from conformance.plan.usage import INTERRUPTED, USAGE_ERROR, Interrupted, UsageError
from conformance.run.interrupt_redelivery import keep_interrupts
from conformance.run.quick_exit import exit_now
from conformance.version import specgate_version

FORMAT = argparse.ArgumentDefaultsHelpFormatter


@dataclass(frozen=True)
class Command:
    """A subcommand: its module (imported only when the command runs or shows its help), the
    function there that adds its arguments and the one that runs it, and its one-line help.
    A command with ``actions`` has subcommands of its own instead."""

    help: str
    module: str = ""
    run: str = ""
    arguments: str = "add_arguments"
    actions: dict[str, Command] = field(default_factory=dict)


COMMANDS = {
    "certify": Command("run the conformance suite against a backend and write report.md, "
                       "report.json and junit.xml", "conformance.run.certify", "cmd_certify"),
    "golden": Command("record or check golden acceptance traces (serial)",
                      "conformance.checks.commands", "cmd_golden", "add_golden_arguments"),
    "expected": Command("record or check the committed expected outputs the oracle answers "
                        "from (checked against transformers)", "conformance.checks.commands",
                        "cmd_expected", "add_expected_arguments"),
    "mutants": Command("run the suite against every bug-zoo mutant; exit 1 if any survives",
                       "conformance.run.mutants", "cmd_mutants"),
    "bench": Command("tokens/s of backends side by side, with ratios",
                     "conformance.bench.command", "cmd_bench"),
    "repro": Command("replay a repro file (a failing check's scenario) against a backend; exit "
                     "1 if it diverges", "conformance.repro.command", "cmd_repro"),
    "report": Command("work with certificates: merge shards, record durations", actions={
        "merge": Command("join the certificates of certify --shard runs into one",
                         "conformance.report.merge", "cmd_merge"),
        "durations": Command("record the table certify --shard balances by, from "
                             "certificates", "conformance.report.durations", "cmd_durations")}),
    "cache": Command("the compiled keys the reference engine's 'aot' graph executor keeps "
                     "between processes ($SPECGATE_CACHE_DIR, else the user cache directory)",
                     "conformance.run.cache_command", "cmd_cache"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise UsageError(message)


def _add_command(sub: argparse._SubParsersAction, name: str, command: Command,
                 with_arguments: bool) -> None:
    parser = sub.add_parser(name, formatter_class=FORMAT, help=command.help)
    if command.actions:
        actions = parser.add_subparsers(dest="action", parser_class=_Parser, metavar="ACTION")
        actions.required = True
        for action, nested in command.actions.items():
            _add_command(actions, action, nested, with_arguments)
    elif with_arguments:
        module = importlib.import_module(command.module)
        getattr(module, command.arguments)(parser)
        parser.set_defaults(func=getattr(module, command.run))


def build_parser(with_arguments: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; the arguments only of those in ``with_arguments`` (None:
    of every command), whose modules are imported to add them."""
    parser = _Parser(prog="specgate", formatter_class=FORMAT, description="Conformance harness "
                     "for speculative decoding, with a compact reference engine. Exit codes: "
                     "0 passed, 1 a check failed, 2 usage error, 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"specgate {specgate_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    chosen = set(COMMANDS if with_arguments is None else with_arguments)
    for name, command in COMMANDS.items():
        _add_command(sub, name, command, name in chosen)
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_interrupts()
    argv = sys.argv[1:] if argv is None else argv
    # the command is the first word that is no option: the top level has no option with a value
    named = next((word for word in argv if not word.startswith("-")), None)
    try:
        args = build_parser([named] if named else []).parse_args(argv)
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
