"""The engine's writer rule: only the schedule and resolve phases change KV bookkeeping.

A decode step is schedule -> launch -> resolve. Schedule decides and allocates (prefill slots,
every decode reservation), launch reads the bookkeeping and writes KV *tensors* into the slots
it was given, resolve commits and frees. So a call of a bookkeeping mutator (the KV manager's,
the allocator's, the row table's) or a write of a request's KV lengths, row or the row table
may only appear in:

* ``refengine/scheduler.py`` (schedule: admission, allocation, reservation, retraction);
* ``refengine/output.py`` (resolve: commit, release at finish);
* ``refengine/memory/`` (the bookkeeping itself, and the streaming sessions, which keep or
  free a finished turn's KV as part of its release).

Moving accepted KV values between slots a request already owns (``KVManager.move_path``) is a
tensor write, allowed in launch. The walk covers every module of ``refengine/``, module-level
and nested code alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "refengine"
ALLOWED = ("scheduler.py", "output.py", "memory/")
# Mutators by the object they are called on (the receiver's last name).
MUTATORS = {
    "kv": {"assign_row", "extend", "grow", "commit", "commit_path", "truncate", "reserve",
           "reserved", "unclaim", "release", "retract", "lend", "keep", "free_kept", "scoring"},
    "allocator": {"alloc_pages", "free_pages"},
    "rows": {"alloc_row", "free_row"},
}
WRITTEN_FIELDS = {"kv_committed_len", "kv_allocated_len", "row", "cached_prefix"}


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every bookkeeping write in ``tree``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _receiver(node.func.value)
            if receiver in MUTATORS and node.func.attr in MUTATORS[receiver]:
                found.append((node.lineno, f"{receiver}.{node.func.attr}()"))
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if not isinstance(getattr(t, "ctx", None), ast.Store):
                    continue
                if isinstance(t, ast.Attribute) and t.attr in WRITTEN_FIELDS and \
                        not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append((node.lineno, f"{t.attr} ="))
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and \
                        t.value.attr == "table":
                    found.append((node.lineno, "table[...] ="))
    return sorted(found)


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for line, what in _writes(ast.parse(path.read_text(), str(path))):
            out.append(f"refengine/{rel}:{line}: {what}")
    return out


def test_only_schedule_and_resolve_write_kv_bookkeeping() -> None:
    assert violations() == [], "KV bookkeeping written outside schedule/resolve"


def test_the_walk_sees_a_launch_side_write(tmp_path: Path) -> None:
    """The rule has teeth: a launch-side allocation, commit or row-table write is found."""
    (tmp_path / "runner.py").write_text(
        "def prepare(self, req, n):\n"
        "    slots = self.kv.extend(req, n)\n"
        "    kv.commit(req, n)\n"
        "    self.kv.rows.table[req.row, 0] = 1\n"
        "    req.kv_committed_len += n\n"
        "    ids = []\n"
        "    ids.extend(slots)\n")
    assert violations(tmp_path) == [
        "refengine/runner.py:2: kv.extend()", "refengine/runner.py:3: kv.commit()",
        "refengine/runner.py:4: table[...] =", "refengine/runner.py:5: kv_committed_len ="]
