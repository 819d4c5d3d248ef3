"""docs/cli.md documents every option of every ``specgate`` subcommand, in that command's
section (options read from the argparse parser itself, so a new flag without docs fails)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from conformance.cli import build_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def subcommand_options(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Subcommand -> its option strings (a command's own subcommands' included), leaving out
    ``--help`` and options hidden on purpose (``help=argparse.SUPPRESS``)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: _options(command) for name, command in sub.choices.items()}


def _options(command: argparse.ArgumentParser) -> list[str]:
    found = []
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [o for nested in action.choices.values() for o in _options(nested)]
        elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            found += action.option_strings
    return list(dict.fromkeys(found))


def sections(text: str) -> dict[str, str]:
    """``## `specgate NAME ...``` heading -> the text up to the next heading of that level."""
    parts = re.split(r"^## ", text, flags=re.M)
    found = {}
    for part in parts[1:]:
        m = re.match(r"`specgate (\w+)", part)
        if m:
            found[m.group(1)] = part
    return found


def undocumented(options: dict[str, list[str]], docs: dict[str, str]) -> list[str]:
    return [f"{name} {opt}" for name, opts in options.items() for opt in opts
            if f"`{opt}" not in docs.get(name, "")]


def test_every_cli_option_is_in_docs_cli_md() -> None:
    options = subcommand_options(build_parser())
    assert set(options) == {"certify", "golden", "expected", "mutants", "bench", "report", "repro",
                            "cache"}
    docs = sections(DOC.read_text())
    assert set(options) <= set(docs), f"commands without a section: {set(options) - set(docs)}"
    assert undocumented(options, docs) == []


def test_a_missing_option_is_reported() -> None:
    options = subcommand_options(build_parser())
    docs = sections(DOC.read_text())
    docs["certify"] = docs["certify"].replace("`--draft-model", "`--draft")
    assert undocumented(options, docs) == ["certify --draft-model"]
