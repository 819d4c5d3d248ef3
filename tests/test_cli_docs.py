"""docs/cli.md documents every option of every ``specgate`` subcommand, in that command's
section, and every ``--specgate-*`` pytest option in the plain-pytest section (options read from
the argparse parser and the plugins themselves, so a new flag without docs fails); its table of
graph executors is the registry's."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from conformance.cli import build_parser
from conformance.run import only, shard
from conformance.run.options import add_suite_options
from refengine.graph.executors import EXECUTORS

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


class _Options:
    """Stands in for pytest's parser: notes the option names a plugin adds."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def getgroup(self, *args: object, **kwargs: object) -> _Options:
        return self

    def addoption(self, *names: str, **kwargs: object) -> None:
        self.names.extend(names)


def pytest_options() -> list[str]:
    """Every option the specgate plugin and its selection and shard plugins add."""
    found = _Options()
    for add in (add_suite_options, only.pytest_addoption, shard.pytest_addoption):
        add(found)  # duck-typed: only getgroup and addoption are called
    return found.names


def test_every_pytest_option_is_in_the_plain_pytest_section() -> None:
    section = re.split(r"^## Plain pytest", DOC.read_text(), flags=re.M)[1].split("\n## ")[0]
    options = pytest_options()
    assert {"--specgate-plan", "--specgate-draft-model", "--specgate-shard"} <= set(options)
    assert [o for o in options if f"| `{o}` |" not in section] == []


def test_the_executor_table_is_the_registrys() -> None:
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \| .*$", DOC.read_text(),
                                                         flags=re.M)}
    for name, info in EXECUTORS.items():
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        assert cells[1:3] == [info.device, "yes" if info.compiles else "no"], name
        assert cells[3].startswith("yes" if info.persists else "no"), name
        assert cells[4] == f"×{info.timeout_factor}" and cells[5] == info.description, name
