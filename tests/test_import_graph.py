"""The import graph, read from the source (module-level and function-level imports alike,
``TYPE_CHECKING`` blocks included): no cycle anywhere in ``refengine``, ``conformance`` or
``specwire``, the engine never imports conformance, and the contract imports nothing but
itself, ``specwire`` and the standard library. A lazy import hides a circle from the
interpreter, not from a reader, so it counts like any other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conformance", "refengine", "specwire")


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name an import statement anywhere in the file names (``from a import b``
    gives ``a`` and ``a.b``)."""
    names: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest known prefix;
    a package's own submodules importing it do not count as an edge)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {resolve(n) for n in imported_names(name, path)}
        edges[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_engine_never_imports_conformance() -> None:
    edges = graph()
    assert [(m, t) for m, ts in edges.items() if m.startswith(("refengine", "specwire"))
            for t in ts if t.startswith("conformance")] == []


def test_the_contract_imports_only_itself_and_specwire() -> None:
    edges = graph()
    assert [(m, t) for m, ts in edges.items() if m.startswith("conformance.contract")
            for t in ts if not t.startswith(("conformance.contract", "specwire"))] == []


# The suite's layers, bottom up: what each may import of conformance besides itself (and the
# contract, specwire and the engine, which every layer may use).
LAYER_ALLOWS = {
    "conformance.plan": (),
    "conformance.report": ("conformance.plan", "conformance.version"),
    "conformance.checks": ("conformance.plan", "conformance.report", "conformance.version"),
}


def arrows_up(edges: dict[str, set[str]], layer: str, allowed: tuple[str, ...]
              ) -> list[tuple[str, str]]:
    """The imports from ``layer`` into conformance packages it may not reach."""
    own = (layer, "conformance.contract", *allowed)
    return sorted((m, t) for m, ts in edges.items() if m.startswith(layer)
                  for t in ts if t.startswith("conformance") and not t.startswith(own))


def test_the_layers_import_only_downward() -> None:
    edges = graph()
    assert {layer: arrows_up(edges, layer, allowed)
            for layer, allowed in LAYER_ALLOWS.items()} == {layer: [] for layer in LAYER_ALLOWS}


def test_an_upward_arrow_is_found() -> None:
    edges = {"conformance.report.merge": {"conformance.run.usage", "conformance.plan.specs"}}
    assert arrows_up(edges, "conformance.report", LAYER_ALLOWS["conformance.report"]) == [
        ("conformance.report.merge", "conformance.run.usage")]


def test_a_cycle_is_found(tmp_path: Path) -> None:
    for name, text in {"conformance/__init__.py": "",
                       "conformance/a.py": "def f():\n    from conformance import b\n",
                       "conformance/b.py": "from conformance.a import f\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cycles(graph(tmp_path)) == [["conformance.a", "conformance.b"]]
