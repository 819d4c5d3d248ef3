"""The vLLM backend's shipped known failures hold together: every entry names a repro file that
ships beside it (package data, so an installed specgate has both), whose runs cover the specs
the entry lists; every repro file is some entry's; each has its regression module under
tests/vllm_known_failures/, exactly what `specgate repro --emit-pytest` writes from it (so
the two cannot drift); and `tox -e vllm` certifies with the file. The replays themselves are
those modules' (refengine clean; vLLM a strict expected failure, docs/backends/vllm.md)."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

import pytest

from conformance.plan.specs import SPECS
from conformance.repro.emit import emit_pytest
from conformance.repro.scenario import Scenario, load
from conformance.run.known_failures import KnownFailure, load_known

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "conformance" / "backends" / "vllm"
KNOWN = PACKAGE / "known-failures.toml"
REPROS = PACKAGE / "repros"
MODULES = REPO / "tests" / "vllm_known_failures"


def module_for(repro: Path) -> str:
    """The emitted module's name: ``test_vllm_`` and the check's name, in word characters."""
    check = repro.stem.split(".", 1)[1].removeprefix("test_")
    return f"test_vllm_{re.sub(r'[^A-Za-z0-9]+', '_', check)}.py"


def entries() -> list[KnownFailure]:
    return load_known(KNOWN)


def cited(entry: KnownFailure) -> Path:
    assert entry.repro, f"{entry.check}: names no repro file"
    return Path(entry.repro).resolve()


def spec_names(scenario: Scenario) -> set[str]:
    return {name for run in scenario.runs for name, choice in SPECS.items()
            if choice.configs and choice.configs[0] == run.config.spec}


def test_every_entry_cites_a_repro_file_covering_its_specs() -> None:
    listed = entries()
    assert listed, "no known failures listed"
    for entry in listed:
        repro = cited(entry)
        assert repro.is_file(), f"{entry.check}: {repro} is missing"
        ran = spec_names(load(repro))
        # an entry for every spec needs a repro of some spec; a listed spec, one of its own
        specs = ({entry.spec} if isinstance(entry.spec, str) else set(entry.spec or ())) or ran
        assert specs and specs <= ran, (
            f"{entry.check}: lists {sorted(specs)}, {repro.name} runs "
            f"{sorted(ran)}")


def test_every_repro_file_is_an_entrys() -> None:
    files = sorted(REPROS.glob("*.json"))
    assert {cited(e) for e in entries()} == set(files)
    checks = {e.check for e in entries()}
    for repro in files:
        scenario = load(repro)
        assert scenario.check in checks and scenario.backend == "vllm", repro.name


def test_each_repro_file_has_its_emitted_module() -> None:
    files = sorted(REPROS.glob("*.json"))
    assert sorted(p.name for p in MODULES.glob("test_*.py")) == sorted(map(module_for, files))
    for repro in files:
        name = module_for(repro)
        assert (MODULES / name).read_text() == emit_pytest(load(repro), name), (
            f"{name} is not what `specgate repro {repro.relative_to(REPO)} --emit-pytest` "
            "writes: emit it again")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python >= 3.11")
def test_the_files_ship_in_the_wheel() -> None:
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["conformance.backends.vllm"]
    for path in [KNOWN, *REPROS.glob("*.json")]:
        relative = path.relative_to(PACKAGE).as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative


def test_tox_vllm_certifies_with_them() -> None:
    tox = (REPO / "tox.ini").read_text()
    env = tox.split("[testenv:vllm]", 1)[1].split("\n[", 1)[0]
    commands = env.split("commands =", 1)[1].replace("\\\n", " ")
    certify = [line for line in commands.splitlines() if "specgate certify" in line]
    assert certify and all(f"--known-failures {{tox_root}}/{KNOWN.relative_to(REPO)}" in line
                           for line in certify), certify
    assert "tests/vllm_known_failures" in commands
