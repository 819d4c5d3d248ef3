"""The vLLM known failures' regression repros (``specgate repro --emit-pytest`` modules, one per
repro file in conformance/backends/vllm/repros/), run in the project's tests.

An emitted module replays its scenario on the backend ``--specgate-backend`` names and has no
default. Here, without a name, each runs twice: on ``refengine``, which must pass (the
scenario is sound: the reference engine is clean on it), and on ``vllm``, marked a strict
expected failure (the bug is known: conformance/backends/vllm/known-failures.toml), skipped
where vLLM is not installed (the dev venv; ``tox -e vllm`` runs it). A fixed vLLM makes that
an unexpected pass, which fails: drop the known failure then. With ``--specgate-backend NAME``
each runs on NAME alone, as the module does anywhere else.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from conformance.contract import Backend
from conformance.plan.registry import BackendError, load_backend

KNOWN_ON = "vllm"
REFERENCE = "refengine"


def _named(config: pytest.Config) -> str | None:
    return config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "specgate_backend" in metafunc.fixturenames:
        names = [_named(metafunc.config) or name for name in (REFERENCE, KNOWN_ON)]
        metafunc.parametrize("specgate_backend", list(dict.fromkeys(names)), indirect=True)


@pytest.fixture
def specgate_backend(request: pytest.FixtureRequest) -> Backend:
    name = request.param
    if _named(request.config) is None and name == KNOWN_ON:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed (tox -e vllm replays these on it)")
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="known vLLM failure (conformance/backends/vllm/"
                                "known-failures.toml); passing means vLLM fixed it"))
    try:
        backend = load_backend(name)
    except BackendError as err:
        raise pytest.UsageError(str(err)) from None
    print(f"specgate: replaying on backend {name!r}")
    return backend
