"""The specgate pytest plugin (entry point ``pytest11: specgate``), loaded into every pytest
session of an environment where specgate is installed, so it imports no torch and no engine.

It adds the ``--specgate-*`` options and the suite's markers (``conformance.run.options``), and
the ``sg`` and ``specgate_backend`` fixtures. The hooks that run the suite
(``conformance.run.suite_hooks``, which import torch and the engine) are registered only in a
session that runs the suite: one given a plan, a backend ($SPECGATE_BACKEND too) or a results
file, one naming the suite's modules, or one that collects a suite check. A repro module's
``specgate_backend`` fixture loads its backend itself, when a test uses it.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conformance.run.options import add_suite_markers, add_suite_options, asks_for_suite

if TYPE_CHECKING:
    from conformance.contract import Backend
    from conformance.run.context import SuiteContext

SUITE_HOOKS = "specgate-suite"  # the name the suite's hooks are registered under
SUITE_HOOKS_MODULE = "conformance.run.suite_hooks"
SUITE_DIR = Path(__file__).resolve().parent.parent / "suites"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_suite_options(parser)


def _runs_suite_modules(config: pytest.Config) -> bool:
    """Whether the session's arguments name the suite (``conformance/suites`` or a module in it,
    by path or with ``--pyargs``)."""
    for arg in config.args:
        where = arg.split("::")[0]
        path = Path(where).resolve()
        if where.startswith("conformance.suites") or SUITE_DIR in (path, *path.parents):
            return True
    return False


def activate(config: pytest.Config) -> None:
    """Register the hooks that run the suite, once per session."""
    if not config.pluginmanager.has_plugin(SUITE_HOOKS):
        # by its module name: the module the suite's checks import, also where a session
        # before this one in the process (pytester) dropped its modules from sys.modules
        config.pluginmanager.register(importlib.import_module(SUITE_HOOKS_MODULE), SUITE_HOOKS)


def pytest_configure(config: pytest.Config) -> None:
    add_suite_markers(config)
    if asks_for_suite(config) or _runs_suite_modules(config):
        activate(config)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A suite check collected where nothing asked for the suite before: its hooks are
    registered now, after ``pytest_sessionstart``."""
    if (item.get_closest_marker("specgate_tier")
            and not item.config.pluginmanager.has_plugin(SUITE_HOOKS)):
        activate(item.config)
        from conformance.run.interrupt_redelivery import keep_interrupts

        keep_interrupts()


@pytest.fixture
def specgate_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend ``--specgate-backend`` (or $SPECGATE_BACKEND) names: what a regression repro
    module (``specgate repro --emit-pytest``) replays its scenario on. There is no default: a
    repro run on the reference engine by accident passes while the bug it holds is present,
    so without a name the test fails, saying which backend recorded it."""
    from conformance.plan.registry import BackendError, load_backend

    name = request.config.getoption("--specgate-backend") or os.environ.get("SPECGATE_BACKEND")
    if not name:
        recorded = getattr(request.module, "RECORDED_ON", None)
        pytest.fail("no backend to replay on: run this repro with --specgate-backend NAME (or "
                    "SPECGATE_BACKEND=NAME)"
                    + (f"; it was recorded on {recorded!r}" if recorded else ""), pytrace=False)
    try:
        backend = load_backend(name)
    except BackendError as err:
        raise pytest.UsageError(str(err)) from None
    request.node.user_properties.append(("specgate_replayed_on", name))
    print(f"specgate: replaying on backend {name!r}")  # shown with -s, -rA, and on failure
    return backend


@pytest.fixture(scope="session")
def sg(request: pytest.FixtureRequest) -> SuiteContext:
    """The suite context: backend under test, its capabilities, spec, profile, oracle.

    The suite's tiny models are bound by per-op overhead, and torch's intra-op threads stall
    badly when pytest-xdist workers share the cores: each suite process uses one thread.
    """
    import torch

    from conformance.run.context import context

    torch.set_num_threads(1)
    return context(request.config)
