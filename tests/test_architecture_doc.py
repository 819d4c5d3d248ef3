"""docs/architecture.md names every module and package of ``refengine`` and ``conformance``.

The doc writes a path relative to its package's root (``memory/manager.py``,
``run/certify.py``), or the whole path (``conformance/backends/refengine/graph_probe.py``),
and inside a paragraph about one directory the file name alone (``ngram_lookup.py`` among the
drafters, ``graph_world.py`` among the reference engine's backend files). So a module is named
by an inline-code path that ends with two or more of its path's last components (or is its
path from the root), and by its bare file name only where no other module of its package has
that name (``adapter.py`` alone names none of the adapters). A package is named the same way,
as a directory with a trailing slash (``speculative/``, ``backends/vllm/``), or by a path
through it (``model/eagle.py`` names ``model/``). ``__init__.py`` files are their packages.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("refengine", "conformance")
PATH = re.compile(r"[\w.]+(?:/[\w.]+)*/?")


def mentioned(doc: str) -> set[str]:
    """Every path-like word inside an inline code span of ``doc`` (fenced blocks left out),
    and the directories it names on the way (``model/`` in ``model/eagle.py``)."""
    prose = re.sub(r"^```.*?^```", "", doc, flags=re.MULTILINE | re.DOTALL)
    words = {m for span in re.findall(r"`([^`]+)`", prose) for m in PATH.findall(span)}
    return words | {w[:i + 1] for w in words for i, c in enumerate(w) if c == "/"}


def modules(package: str) -> list[str]:
    """The package's modules (``.py`` files but ``__init__.py``) and sub-packages (with a
    trailing slash), as paths relative to its root."""
    root = ROOT / package
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        if path.name != "__init__.py":
            found.append(rel.as_posix())
        elif len(rel.parts) > 1:
            found.append(rel.parent.as_posix() + "/")
    return found


def name_of(rel: str) -> str:
    """A module's file name, or a package's directory name with its slash."""
    return rel.rstrip("/").rsplit("/", 1)[-1] + ("/" if rel.endswith("/") else "")


def forms(package: str, rel: str, unique_name: bool) -> set[str]:
    """The ways the doc may write the module or package ``rel`` of ``package``: its whole
    path, its path from the root, every suffix of two components or more between them; the
    bare name too where ``unique_name``."""
    slash = "/" if rel.endswith("/") else ""
    full = [package, *rel.rstrip("/").split("/")]
    shortest = 1 if unique_name else min(2, len(full) - 1)
    return {"/".join(full[i:]) + slash for i in range(len(full) - shortest + 1)}


def missing(package: str, doc: str) -> list[str]:
    """The package's modules and packages the doc does not name, relative to its root."""
    said = mentioned(doc)
    found = modules(package)
    names = Counter(name_of(rel) for rel in found)
    return [rel for rel in found if not forms(package, rel, names[name_of(rel)] == 1) & said]


def test_the_forms_follow_the_docs_convention() -> None:
    assert forms("conformance", "run/certify.py", False) == {
        "conformance/run/certify.py", "run/certify.py"}
    assert "graph_probe.py" in forms("conformance", "backends/refengine/graph_probe.py", True)
    assert forms("refengine", "speculative/", True) == {"refengine/speculative/",
                                                        "speculative/"}
    assert forms("refengine", "runner.py", False) == {"refengine/runner.py", "runner.py"}
    assert mentioned("see `speculative/core.py` (the core) and `memory/`, `a|b`") == {
        "speculative/core.py", "speculative/", "memory/", "a", "b"}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_named_in_the_architecture_doc(package: str) -> None:
    absent = missing(package, DOC.read_text())
    assert not absent, (f"docs/architecture.md does not name {len(absent)} module(s) of "
                        f"{package}/: {', '.join(absent)}")
