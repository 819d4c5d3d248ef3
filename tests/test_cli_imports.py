"""What the command line and the pytest plugin import: ``specgate --version`` and ``--help``
neither torch nor the engine (a command's module loads only when it runs or shows its help),
and a pytest session that asks nothing of specgate no torch, although the plugin is loaded
into every session of an environment where specgate is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_run_plan import plugin_args

HEAVY = ("torch", "refengine")
ROOT = Path(__file__).resolve().parent.parent


def imported(*argv: str) -> set[str]:
    """The modules ``python -X importtime`` reports for ``argv``."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rpartition("|")[2].strip() for line in done.stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_import_neither_torch_nor_the_engine(argv: list[str]) -> None:
    names = imported("-m", "conformance.cli", *argv)
    assert "conformance.version" in names  # the command ran (as __main__)
    assert sorted(n for n in names if n.split(".")[0] in HEAVY) == []
    assert not {"conformance.run.certify", "conformance.bench.command"} & names


@pytest.mark.parametrize("command", ["certify", "mutants", "bench", "golden", "expected",
                                     "repro", "report merge", "cache"])
def test_a_commands_help_imports_neither_torch_nor_pytest(command: str) -> None:
    assert not {"torch", "pytest"} & imported("-m", "conformance.cli", *command.split(), "--help")


def session_modules(where: Path, *args: str) -> tuple[list[str], bool]:
    """The torch modules, and whether the suite's hooks were registered, at the end of a
    pytest session in ``where`` (a conftest there writes them down)."""
    (where / "conftest.py").write_text(
        "import json, sys\n\n\ndef pytest_sessionfinish(session):\n"
        "    json.dump([sorted(m for m in sys.modules if m.split('.')[0] == 'torch'),\n"
        "               session.config.pluginmanager.has_plugin('specgate-suite')],\n"
        "              open('loaded.json', 'w'))\n")
    (where / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECGATE_", "PYTEST_"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *plugin_args(), *args], cwd=where, env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import json

    torch_modules, hooked = json.loads((where / "loaded.json").read_text())
    return torch_modules, hooked


def test_a_session_without_specgate_options_imports_no_torch(tmp_path: Path) -> None:
    torch_modules, hooked = session_modules(tmp_path)
    assert torch_modules == [] and not hooked


def test_a_session_naming_a_backend_runs_the_suites_hooks(tmp_path: Path) -> None:
    torch_modules, hooked = session_modules(tmp_path, "--specgate-backend", "refengine")
    assert torch_modules and hooked


def test_an_engine_with_a_draft_head_loads_without_torch_dynamo() -> None:
    """Every suite process opens engines; building a model on the meta device with its
    random init would import torch._dynamo (a second of start-up per process) for values the
    checkpoint replaces. The init is skipped, and only while the model is built."""
    names = imported("-c", (
        "import torch\n"
        "from refengine import Engine, EngineConfig, SamplingParams\n"
        "from conformance.plan.specs import SPECS\n"
        "for name in ('eagle', 'eagle3', 'mtp', 'draft-model'):\n"
        "    engine = Engine(EngineConfig(model='tiny-code', spec=SPECS[name].configs[0]))\n"
        "    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))\n"
        "assert torch.nn.Linear(64, 64).weight.std() > 0  # init outside a build is untouched\n"))
    assert "refengine.model.eagle3" in names
    assert "torch._dynamo" not in names
