"""The wheel cannot silently drop a module: every code directory is a discoverable package.

`setup.py` finds packages by their `__init__.py`; a directory of modules without one would be
left out of the wheel while an editable install (or a checkout) still imports it. CI also
installs the built wheel outside the checkout and certifies from there (`.ci/wheel-check`).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("refengine", "conformance")


def setup_call() -> dict[str, object]:
    """The arguments setup.py passes to setuptools.setup (without building anything)."""
    seen: dict[str, object] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
        patch.chdir(REPO)
        runpy.run_path(str(REPO / "setup.py"))
    return seen


@pytest.mark.parametrize("root", CODE_ROOTS)
def test_every_directory_of_modules_is_a_package(root: str) -> None:
    missing = sorted(str(d.relative_to(REPO)) for d in (REPO / root).rglob("*")
                     if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
                     and not (d / "__init__.py").exists())
    assert not missing, f"directories without __init__.py (left out of the wheel): {missing}"


def test_setup_lists_every_code_package_and_the_data() -> None:
    kwargs = setup_call()
    packages = set(kwargs["packages"])  # type: ignore[arg-type]
    on_disk = {".".join(d.relative_to(REPO).parts) for root in CODE_ROOTS
               for d in [REPO / root, *(REPO / root).rglob("*")]
               if (d / "__init__.py").exists()}
    assert on_disk <= packages and {"refengine.speculative", "refengine.kernels"} <= packages
    data = kwargs["package_dir"]
    assert data == {"refengine._fixtures": "fixtures", "refengine._golden": "golden"}
    assert all((REPO / folder).is_dir() for folder in data.values())  # type: ignore[union-attr]


def test_runtime_leaves_heavy_and_test_tools_to_extras() -> None:
    """`specgate certify` on the bundled engine needs none of these; they are extras."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {req.split(">")[0].split("=")[0].split("<")[0].strip()
               for req in project["dependencies"]}
    assert not runtime & {"triton", "transformers", "syrupy", "coverage", "ruff"}
    extras = project["optional-dependencies"]
    assert extras["kernels"][0].startswith("triton") and extras["hf"][0].startswith("transformers")
