"""junit.xml after the suite ran: indented, known failures marked as skipped (so a CI test
report shows what the certificate says), an interrupted run marked incomplete, and the shards'
files joined into one (``specgate report merge``).

pytest writes one ``<testsuite>`` whose ``<testcase classname="test_lossless" name="...">`` are
the checks; a check's node id ``test_lossless.py::name`` maps to that pair.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from specwire.untrusted import MAX_DEPTH, MiB, UntrustedFileError, read_text

_VERDICTS = ("failure", "error", "skipped")
MAX_JUNIT_BYTES = 256 * MiB


def testcase_id(case: ET.Element) -> str:
    """The node id (relative to the suite directory) a testcase element stands for."""
    parts = str(case.get("classname", "")).split(".")
    module = "/".join(parts[:1]) + ".py"
    return "::".join([module, *parts[1:], str(case.get("name", ""))])


def _recount(suite: ET.Element) -> None:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for verdict, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
        suite.set(attr, str(sum(1 for c in cases if c.find(verdict) is not None)))
    suite.set("time", f"{sum(float(c.get('time', 0)) for c in cases):.3f}")


def _write(tree: ET.ElementTree, path: Path) -> None:
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def indent_junit(path: Path) -> None:
    """pytest writes junit.xml on one line; indent it so a diff or a reader can follow it."""
    _write(ET.parse(path), path)


def mark_known(path: Path, reasons: dict[str, str]) -> None:
    """The testcases of known failures (node id -> reason) become skipped, with the reason."""
    if not reasons or not path.exists():
        return
    tree = ET.parse(path)
    for suite in tree.getroot().iter("testsuite"):
        for case in suite.findall("testcase"):
            reason = reasons.get(testcase_id(case))
            if reason is None:
                continue
            for child in [c for c in case if c.tag in _VERDICTS]:
                case.remove(child)
            ET.SubElement(case, "skipped", type="known failure",
                          message=f"known failure: {reason}")
        _recount(suite)
    _write(tree, path)


def mark_incomplete(path: Path, finished: int, collected: int) -> None:
    """An interrupted run's junit.xml says so: one more testcase, ``specgate.run_incomplete``,
    with an error naming how many checks finished, so a CI test report cannot read the checks
    that happened to finish as the whole run passing."""
    if not path.exists():
        return
    tree = ET.parse(path)
    suite = next(tree.getroot().iter("testsuite"), None)
    if suite is None:
        return
    for nameless in [c for c in suite.findall("testcase") if not c.get("name")]:
        suite.remove(nameless)  # what pytest leaves of a check cut short: no id, no verdict
    case = ET.SubElement(suite, "testcase", classname="specgate", name="run_incomplete",
                         time="0")
    ET.SubElement(case, "error", type="incomplete",
                  message=f"the run was interrupted: {finished} of {collected} checks finished; "
                          "the rest did not run, and this run certifies nothing")
    suite.set("specgate_incomplete", "true")
    _recount(suite)
    _write(tree, path)


def read_junit(path: Path) -> ET.Element:
    """A shard's junit.xml (from another machine) as untrusted data: bounded in size and depth
    (writing it back out recurses), its times numbers; UntrustedFileError (one line) if not."""
    where = str(path)
    try:
        root = ET.fromstring(read_text(path, where, MAX_JUNIT_BYTES))
    except ET.ParseError as err:
        raise UntrustedFileError(f"{where}: not XML ({err})") from None
    stack = [(root, 0)]
    while stack:
        element, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise UntrustedFileError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if element.tag == "testcase":
            try:
                float(element.get("time", 0))
            except ValueError:
                raise UntrustedFileError(f"{where}: a testcase time is not a number") from None
        stack.extend((child, depth + 1) for child in element)
    return root


def merge_junit(paths: list[Path], out: Path) -> None:
    """One junit.xml with every shard's testcases in one testsuite (counts recomputed)."""
    root = ET.Element("testsuites", name="specgate")
    merged: ET.Element | None = None
    for path in paths:
        for suite in read_junit(path).iter("testsuite"):
            if merged is None:
                merged = ET.SubElement(root, "testsuite", dict(suite.attrib))
                merged.extend(suite.findall("properties"))
            merged.extend(suite.findall("testcase"))
    if merged is None:
        merged = ET.SubElement(root, "testsuite", name="pytest")
    _recount(merged)
    _write(ET.ElementTree(root), out)
