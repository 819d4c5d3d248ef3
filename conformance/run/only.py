"""``certify --only NODEID[,NODEID...]``: rerun single checks, named by their node ids as
report.json lists them (``test_lossless.py::test_greedy_matches_reference[...]``, relative to
the suite directory).

``parse_only`` checks the ids before any work: each must name a suite module. The pytest plugin
(``--specgate-only``, loaded with the suite) keeps exactly the checks named. Selecting by id
after collection, rather than handing pytest the ids (which stops at an id it cannot find),
lets ``--spec all`` run the ids that exist in each spec; certify warns about an id that names
no check, and a run left with no check is refused as vacuous.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# a comma starts the next id only where a suite module's name follows it: a parametrize id may
# hold commas of its own
_NEXT_ID = re.compile(r",(?=\s*test_\w+\.py(?:::|$))")


def parse_only(values: list[str], suites: Path) -> list[str]:
    """The node ids in ``values`` (each comma-separated); ValueError naming the first id whose
    file is not a suite module."""
    ids = [i.strip() for value in values for i in _NEXT_ID.split(value) if i.strip()]
    modules = {p.name for p in suites.glob("test_*.py")}
    for nodeid in ids:
        module = nodeid.split("::", 1)[0]
        if module not in modules:
            raise ValueError(f"--only {nodeid}: {module!r} is not a suite module (known: "
                             f"{', '.join(sorted(modules))})")
    return list(dict.fromkeys(ids))


def only_modules(ids: list[str], suites: Path) -> list[str]:
    """The suite files the ids live in: what pytest needs to collect."""
    return [str(suites / m) for m in dict.fromkeys(i.split("::", 1)[0] for i in ids)]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specgate", "specgate conformance suite")
    group.addoption("--specgate-only", action="append", default=[],
                    help="run only the check with this node id (repeatable)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("--specgate-only"))
    if not wanted:
        return
    dropped = [i for i in items if i.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i.nodeid in wanted]
