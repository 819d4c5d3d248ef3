"""Every loader of a file specgate did not write, fed random and mutated files: it answers with
exit 0 or 2 (merge: 1 too, a shard's failed check) and, on 2, one line without a traceback;
nothing is ever written outside the output directory. Mutations start from a valid file and
either damage its bytes or replace a value anywhere in it with a hostile one (deep nesting,
huge integers, path-like strings, wrong types)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.cli import main
from conformance.run.known_failures import load_known
from conformance.run.shard import load_durations
from tests.test_merge import A, B, cert_dir
from tests.test_repro_file import _doc

hostile_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=20),
    st.sampled_from(["../../ESCAPED", "/nonexistent/specgate-escape", "..", "a/b", "none",
                     "eagle", "x:y", "pytest:main", "os:abort", 'a"""b', "C:\\users\\me",
                     "\u0000", ""]))
json_values = st.recursive(hostile_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document a value can be put."""
    found = [here]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*here, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*here, index))
    return found


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, *rest = path
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[head] = _put(copy[head], tuple(rest), value)
    return copy


@st.composite
def mutated(draw: st.DrawFn, seed: str) -> bytes:
    """``seed`` with one kind of damage: a value replaced, bytes changed, deep nesting or a
    huge integer spliced in, or random bytes."""
    kind = draw(st.sampled_from(["value", "bytes", "nest", "digits", "random"]))
    data = seed.encode()
    if kind == "value":
        doc = json.loads(seed)
        where = draw(st.sampled_from(_paths(doc)))
        return json.dumps(_put(doc, where, draw(json_values))).encode()
    if kind == "random":
        return draw(st.binary(max_size=200))
    at = draw(st.integers(0, len(data)))
    if kind == "nest":
        depth = draw(st.sampled_from([40, 5_000, 100_000]))
        return data[:at] + b"[" * depth + b"]" * depth + data[at:]
    if kind == "digits":
        return data[:at] + b"9" * draw(st.sampled_from([25, 5_000, 100_000])) + data[at:]
    cut = draw(st.integers(0, 20))
    return data[:at] + draw(st.binary(max_size=8)) + data[at + cut:]


def _one_line_or_clean(code: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specgate: error:"), err


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
REPRO = json.dumps(_doc(check="test_a.py::t", failure="boom", backend="refengine"))


@FUZZ
@given(data=mutated(REPRO))
def test_repro_loader(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes) -> None:
    work = tmp_path / "repro-fuzz"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    (work / "repro.json").write_bytes(data)
    out = work / "out" / "test_emitted.py"
    code = main(["repro", str(work / "repro.json"), "--emit-pytest", str(out)])
    _one_line_or_clean(code, capsys.readouterr().err)
    assert _files(work) - {work / "repro.json"} <= {out}
    if code == 0:
        compile(out.read_text(), str(out), "exec")  # the module is Python, whatever the file


KNOWN = '[known-failures]\n"test_a.py::one" = "tracked"\n"test_a.py::two" = { reason = "x", ' \
        'expires = 2026-12-31, spec = "none" }\n'


@FUZZ
@given(data=st.one_of(st.builds(lambda b: b, st.binary(max_size=200)),
                      st.sampled_from([40, 100_000]).map(
                          lambda d: (KNOWN + '"a.py::b" = ' + "[" * d + "]" * d).encode()),
                      st.text(max_size=300).map(lambda t: (KNOWN + t).encode())))
def test_known_failures_loader(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "known.toml"
    path.write_bytes(data)
    try:
        load_known(path)
    except ValueError as err:
        assert "\n" not in str(err) and str(err).startswith("--known-failures")


DURATIONS = json.dumps({"format": 1, "durations": {"none": {"test_a.py::one": 1.5}}})


@FUZZ
@given(data=mutated(DURATIONS))
def test_durations_loader(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "durations.json"
    path.write_bytes(data)
    try:
        load_durations(path)
    except ValueError as err:
        assert "\n" not in str(err) and str(err).startswith("--durations")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    for shard, checks in (("1/2", A), ("2/2", B)):
        cert_dir(root / f"s{shard[0]}", "none", checks, shard=shard)
    return root


@FUZZ
@given(data=st.data(), which=st.sampled_from(["report.json", "junit.xml"]))
def test_merge_and_durations_loaders(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     shards: Path, data: st.DataObject, which: str) -> None:
    work = tmp_path / "merge-fuzz" / "deep"
    shutil.rmtree(work.parent, ignore_errors=True)
    shutil.copytree(shards, work)
    target = work / "s2" / which
    seed = target.read_text()
    if which == "report.json":
        target.write_bytes(data.draw(mutated(seed)))
    else:
        target.write_bytes(data.draw(st.one_of(
            st.binary(max_size=200),
            st.sampled_from([50, 100_000]).map(
                lambda d: seed.replace("</testsuite>", "<a>" * d + "</a>" * d + "</testsuite>")
                .encode()))))
    before = _files(work.parent)
    code = main(["report", "merge", str(work / "s1"), str(work / "s2"), "--out",
                 str(work / "m")])
    _one_line_or_clean(code, capsys.readouterr().err, (0, 1, 2))
    assert {p for p in _files(work.parent) - before if work / "m" not in p.parents} == set()
    if code == 2:
        assert not (work / "m").exists()
    code = main(["report", "durations", str(work / "s1"), str(work / "s2"), "--out",
                 str(work / "d.json")])
    _one_line_or_clean(code, capsys.readouterr().err)
