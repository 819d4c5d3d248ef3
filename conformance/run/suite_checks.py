"""The checks each suite module defines, read from its source (no import, no collection): what
the ``file::function`` part of a check id can be. Collecting the suite would enumerate the
parametrised ids too, but costs an import of every backend-facing module; a file read of the
names is enough to catch a misspelt or renamed check before any work."""

from __future__ import annotations

import ast
from pathlib import Path

SuiteChecks = dict[str, frozenset[str]]  # module file name -> "function" or "Class::method"


def _tests(tree: ast.Module) -> set[str]:
    """The names pytest collects from a module: ``test*`` functions, ``test*`` methods of
    ``Test*`` classes (as ``Class::method``)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test"):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found.update(f"{node.name}::{m.name}" for m in node.body
                         if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and m.name.startswith("test"))
    return found


def suite_checks(suites: Path) -> SuiteChecks:
    """Every suite module (``test_*.py`` in ``suites``) and the checks it defines."""
    return {p.name: frozenset(_tests(ast.parse(p.read_text(), str(p))))
            for p in sorted(suites.glob("test_*.py"))}


def unknown_check(nodeid: str, checks: SuiteChecks) -> str | None:
    """Why ``nodeid`` names no check of the suite (None: its module and function exist; a
    parametrize id in brackets is not checked)."""
    module, _, name = nodeid.partition("::")
    if module not in checks:
        return f"{module!r} is not a suite module (known: {', '.join(checks)})"
    function = name.partition("[")[0]
    if function not in checks[module]:
        return f"{module} defines no check {function!r}"
    return None
