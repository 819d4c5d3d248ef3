"""Files specgate reads are data, as a hostile or careless stranger would write them: a repro
file's backend is never imported, an emitted module never runs a field of the file, a shard
never makes merge write outside ``--out``, and malformed, huge or endless input is exit 2 with
one line (exit 1 keeps its meaning: the failure reproduced)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import assert_usage_error, run
from tests.test_merge import A, B, cert_dir
from tests.test_repro_file import _doc

ROOT = Path(__file__).resolve().parent.parent


def _file(tmp_path: Path, doc: object, name: str = "repro.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _config(**fields: object) -> dict[str, object]:
    doc = _doc()
    doc["runs"][0]["config"].update(fields)  # type: ignore[index]
    return doc


def _submit(**fields: object) -> dict[str, object]:
    doc = _doc()
    doc["runs"][0]["actions"][0].update(fields)  # type: ignore[index]
    return doc


def test_a_file_named_backend_is_never_imported(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "conftest.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for label in ("pytest:main", "this:x", "tests.rewriting_backend:backend"):
        code, out, err = run(capsys, "repro", str(_file(tmp_path, _doc(backend=label))))
        assert_usage_error(code, err, repr(label), "pass it with --backend")
        assert "Beautiful is better" not in out + err
    assert not marker.exists()


def test_os_abort_in_a_file_does_not_abort(tmp_path: Path) -> None:
    path = _file(tmp_path, _doc(backend="os:abort"))
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "repro", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "--backend" in done.stderr


@pytest.mark.parametrize("label", ["refengine", "mutant:leak_on_finish", ""])
def test_a_known_backend_name_in_a_file_is_used(tmp_path: Path, label: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from conformance.repro.command import recorded_backend
    from conformance.repro.scenario import load

    assert recorded_backend(load(_file(tmp_path, _doc(backend=label))), "f") == (
        label or "refengine")


@pytest.mark.parametrize("name", ["../../x:factory", ".x:y", "x:", "a b:c", "x:y.z"])
@pytest.mark.parametrize("command", ["repro", "certify"])
def test_a_malformed_module_factory_is_one_line(tmp_path: Path, name: str, command: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = ([str(_file(tmp_path, _doc()))] if command == "repro"
            else ["--report", str(tmp_path / "r")])
    code, _, err = run(capsys, command, *args, "--backend", name)
    assert_usage_error(code, err, "backend")


HOSTILE_TEXT = 'x"""\nimport os; os.system("touch PWNED")\n"""'


@pytest.mark.parametrize("field", ["check", "failure", "backend"])
@pytest.mark.parametrize("text", [HOSTILE_TEXT, "C:\\users\\me \\u12 \\N{x}", "'''\"\"\"\\"])
def test_emitted_module_carries_fields_as_literals(tmp_path: Path, field: str, text: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "test_emitted.py"
    code, _, err = run(capsys, "repro", str(_file(tmp_path, _doc(**{field: text}))),
                       "--emit-pytest", str(out))
    assert code == 0, err
    module = ast.parse(out.read_text())
    constants = {t.id: node.value for node in module.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    name = {"check": "CHECK", "failure": "FAILURE", "backend": "RECORDED_ON"}[field]
    value = ast.literal_eval(constants[name])
    assert value == (" ".join(text.split()) if field == "failure" else text)
    # nothing but the docstring, imports, the constants and the test function
    kinds = [type(node).__name__ for node in module.body]
    assert kinds == ["Expr", "Import", "ImportFrom", "ImportFrom", "Assign", "Assign", "Assign",
                     "Assign", "FunctionDef"], kinds
    assert not (tmp_path / "PWNED").exists()


def test_emitted_module_collects_and_names_its_test_safely(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    out = tmp_path / "test_emitted.py"
    repro = _file(tmp_path, _doc(check='test_x.py::t[é"\\ \n]'))
    assert run(capsys, "repro", str(repro), "--emit-pytest", str(out))[0] == 0
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", str(out)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode in (0, 4, 5) and "SyntaxError" not in done.stdout + done.stderr, (
        done.stdout + done.stderr)
    assert "test_emitted.py::test_x_t" in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["test_a\"\"\".py", "test_ü.py", "test_a.b.py"])
def test_emit_refuses_an_unsafe_module_name(tmp_path: Path, name: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "repro", str(_file(tmp_path, _doc())), "--emit-pytest",
                       str(tmp_path / name))
    assert_usage_error(code, err, "name it test_")
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("doc, needle", [
    ('{"a":' * 200_000 + "1" + "}" * 200_000, "nested deeper"),
    ('{"specgate_repro": 1, "runs": [], "x": 1' + "0" * 1_000_000 + "}", "beyond 64 bits"),
    (json.dumps(_doc()).replace('"times": 2', '"times": ' + str(10**15)), "times"),
    (_config(kv_pool_tokens=10**12), "kv_pool_tokens"),
    (_submit(params={"max_new_tokens": 10**12}), "max_new_tokens"),
    (_config(graph_executor="warp"), "graph_executor"),
    (_config(device="cuda"), "CUDA"),
    (_config(model="no-such-fixture"), "no-such-fixture"),
    (_submit(prompt_ids=[1, 2048]), "outside the model's vocabulary"),
    (_config(seed=2**64), "beyond 64 bits"),
])
def test_a_bad_repro_is_exit_2_and_one_line(tmp_path: Path, doc: object, needle: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "repro", str(_file(tmp_path, doc)))
    assert_usage_error(code, err, needle)
    assert "reproduced" not in out


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_never_read(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "repro", device)
    assert_usage_error(code, err, "not a regular file")


def test_a_huge_repro_file_is_refused_unread(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(33 * 2**20)
    code, _, err = run(capsys, "repro", str(path))
    assert_usage_error(code, err, "larger than 32 MiB")


def test_deep_known_failures_toml_is_one_line(tmp_path: Path) -> None:
    from conformance.run.known_failures import load_known

    path = tmp_path / "known.toml"
    path.write_text('[known-failures]\n"a.py::b" = ' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="nested deeper") as caught:
        load_known(path)
    assert "\n" not in str(caught.value)
    path.write_text('[known-failures]\n"a.py::b" = ' + "1" * 5000 + "\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_known(path)


@pytest.mark.parametrize("spec", ["../../ESCAPED", "/tmp/abs", "none/../../x", ".."])
def test_merge_never_writes_outside_out(tmp_path: Path, spec: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "a" / "b"
    for shard, checks in (("1/2", A), ("2/2", B)):
        for name in ("none", "eagle"):
            cert_dir(work / f"s{shard[0]}" / name, name, checks, shard=shard)
        report = work / f"s{shard[0]}" / "eagle" / "report.json"
        doc = json.loads(report.read_text())
        report.write_text(json.dumps({**doc, "spec": spec}))
    before = sorted(p for p in tmp_path.rglob("*"))
    code, _, err = run(capsys, "report", "merge", str(work / "s1"), str(work / "s2"), "--out",
                       str(work / "m"))
    assert_usage_error(code, err, "spec")
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_merge_refuses_a_shard_missing_what_a_certificate_needs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = cert_dir(tmp_path / "s1", "none", A, shard="1/2")
    two = cert_dir(tmp_path / "s2", "none", B, shard="2/2")
    for shard in (one, two):
        doc = json.loads((shard / "report.json").read_text())
        del doc["capabilities"]
        (shard / "report.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "report", "merge", str(one), str(two), "--out",
                       str(tmp_path / "m"))
    assert_usage_error(code, err, "capabilities")
    assert not (tmp_path / "m").exists()
